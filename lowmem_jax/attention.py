"""Multi-head attention for ``[B, N, H, D]`` inputs, with a memory-efficient path.

``implementation``:
  * ``"flash"``: ours, pure JAX. Blockwise forward over key/value blocks with an online
    softmax; a custom_vjp that saves only q, k, v, o and the fp32 row log-sum-exp and
    recomputes the scores block by block in backward. No ``N x M`` array is saved, and
    the largest temporary is ``N x block_k`` per head. Runs on every backend.
  * ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (CUDA GPU,
    16-bit; saves q, k, v, o and the row log-sum-exp). A shape it refuses (see
    :func:`cudnn_refusal`) is a ValueError naming the shape, raised before jax is called.
  * ``"cudnn_padded"``: cuDNN on q, k, v zero-padded to even lengths; the padded keys
    are hidden by cuDNN's own key-length mask (``key_value_seq_lengths``, no bias array)
    and the padded query rows are sliced off. Saves what ``"cudnn"`` saves, padded.
  * ``"xla"``: ``jax.nn.dot_product_attention(implementation="xla")``, plain autodiff;
    it saves the ``N x M`` probabilities. The reference.
  * ``"auto"``: :func:`choose_implementation` (cuDNN where it takes the shape and is
    known to be the fast path, else ``"flash"``; never a path that keeps ``N x M``).

Grouped-query attention: k and v may have fewer heads ``K`` than q (``H % K == 0``);
query head ``h`` reads kv head ``h // (H // K)``, as in ``jax.nn.dot_product_attention``.
``mask`` is boolean (True = attend), broadcastable to ``[B, H, N, M]``; a padding mask
``[B, 1, 1, M]`` costs ``B * M``. ``causal`` is top-left aligned (query i sees keys
j <= i). A query row with no visible key returns zeros in ``"flash"`` (the XLA path
returns the mean of v there); mask such rows out of the loss.

Attention dropout (``dropout_rate`` > 0, HF BERT's ``attention_probs_dropout_prob``):
``o = dropout(softmax(s)) @ v``, the kept probabilities scaled by ``1 / (1 - rate)``; the
softmax normalizer is that of the undropped probabilities. The keep-mask is a function of
``dropout_key`` and the shapes (:func:`dropout_keep_mask`): ``"flash"`` draws key block
``j``'s part from ``fold_in(dropout_key, j)`` in forward and draws it again in backward,
so it saves nothing more (q, k, v, o, lse and the key). ``"xla"`` is the plain reference
(softmax, the same mask, matmul; autodiff keeps the ``N x M`` probabilities and the mask).
cuDNN's dropout is not reachable through ``jax.nn.dot_product_attention``: ``"cudnn"`` and
``"cudnn_padded"`` refuse a rate > 0 and ``"auto"`` runs ``"flash"``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import gpu_target
from lowmem_jax.dropout import check_rate, keep_mask

IMPLEMENTATIONS = ("auto", "flash", "cudnn", "cudnn_padded", "xla")
DEFAULT_BLOCK_K = 512


def _validate(q, k, v, mask):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        "attention expects q, k, v of rank 4 [batch, seq, heads, head_dim]; got "
        f"q{list(q.shape)}, k{list(k.shape)}, v{list(v.shape)}")
  if k.shape != v.shape:
    raise ValueError(f"attention: k{list(k.shape)} and v{list(v.shape)} differ in shape")
  b, _, h, d = q.shape
  if k.shape[0] != b or k.shape[3] != d:
    raise ValueError(
        f"attention: batch/head_dim of q{list(q.shape)} and k{list(k.shape)} differ")
  if h % k.shape[2]:
    raise ValueError(
        f"attention: {h} query heads are not a multiple of {k.shape[2]} kv heads")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"attention: q, k, v must be floating point, got {q.dtype}")
  if mask is not None:
    target = (b, h, q.shape[1], k.shape[1])
    if mask.dtype != jnp.bool_:
      raise TypeError(f"attention: mask must be boolean (True = attend), got {mask.dtype}")
    try:
      jnp.broadcast_shapes(mask.shape, target)
    except ValueError:
      raise ValueError(
          f"attention: mask{list(mask.shape)} does not broadcast to [B, H, N, M] = "
          f"{list(target)}") from None
    if mask.ndim != 4:
      raise ValueError(f"attention: mask must have rank 4 [B, H, N, M], got {mask.ndim}")


def attention(q, k, v, *, causal: bool = False, mask=None, implementation: str = "auto",
              scale: float | None = None, block_k: int | None = None,
              name: str | None = None, dropout_rate: float = 0.0,
              dropout_key: jax.Array | None = None):
  """Scaled dot-product attention; returns ``[B, N, H, D]`` in q's dtype.

  ``name`` tags the output with ``checkpoint_name``; in ``"flash"`` it is tagged inside
  the rule, so the saved ``o`` and the output stay one array. ``block_k`` (``"flash"``;
  default :data:`DEFAULT_BLOCK_K`): the most keys per block; the blocks are made equal
  (:func:`key_block`), so ``M`` is padded by less than one block's worth of keys.
  ``dropout_rate`` (a Python float in [0, 1); 0: no dropout, the same program as without
  it) drops attention probabilities with the mask :func:`dropout_keep_mask` draws from
  ``dropout_key`` (one PRNG key) in blocks of ``key_block(M, block_k)`` keys.
  """
  block_k = DEFAULT_BLOCK_K if block_k is None else block_k
  _validate(q, k, v, mask)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"unknown attention implementation {implementation!r}; valid: {', '.join(IMPLEMENTATIONS)}")
  rate = check_rate(dropout_rate, "attention: dropout_rate")
  if rate:
    _check_dropout_key(dropout_key, rate)
    if implementation in ("cudnn", "cudnn_padded"):
      raise ValueError(
          f"attention(implementation={implementation!r}, dropout_rate={rate}): cuDNN "
          "attention dropout is not available through jax's API (jax.nn."
          "dot_product_attention has no dropout); use implementation='flash' (or 'auto', "
          "which runs it)")
  if block_k < 1:
    raise ValueError(f"attention: block_k must be positive, got {block_k}")
  if not isinstance(causal, (bool, np.bool_)):  # static: it picks the program
    raise TypeError(f"attention: causal must be a Python bool, got {causal!r}")
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  mask_shape = None if mask is None else tuple(mask.shape)
  if implementation in ("auto", "cudnn", "cudnn_padded"):
    backend, version, capability = _platform()
  if implementation == "auto":
    implementation = choose_implementation(
        q.shape, k.shape, q.dtype, backend=backend, causal=causal, mask_shape=mask_shape,
        cudnn_version=version, compute_capability=capability,
        dropout_rate=rate).implementation
  elif implementation in ("cudnn", "cudnn_padded"):
    padded = implementation == "cudnn_padded"
    reason = cudnn_refusal(q.shape, k.shape, q.dtype, mask_shape=mask_shape, backend=backend,
                           cudnn_version=version, compute_capability=capability,
                           padded=padded)
    if reason is not None:
      raise ValueError(
          f"attention(implementation={implementation!r}): cuDNN refuses q{list(q.shape)} "
          f"k{list(k.shape)} {jnp.dtype(q.dtype).name} (causal={causal}, mask="
          f"{None if mask is None else list(mask.shape)}): {reason}. "
          "implementation='auto' picks a path that takes this shape.")
  if implementation == "xla" and rate:
    out = _xla_dropout(q, k, v, mask, causal, scale, rate, dropout_key,
                       key_block(k.shape[1], block_k))
  elif implementation in ("xla", "cudnn"):
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal, implementation=implementation)
  elif implementation == "cudnn_padded":
    out = _padded(q, k, v, mask, causal, scale, "cudnn")
  else:
    return _flash(q, k, v, mask, dropout_key if rate else None, causal, scale,
                  key_block(k.shape[1], block_k), name, rate)
  return out if name is None else checkpoint_name(out, name)


# ----------------------------------------------------------------------------- dispatch
# cuDNN's limits as jax states them (jax 0.10.2, jax/_src/cudnn/fused_attention_stablehlo.py,
# `check_layout` and `check_is_flash_attention`; jax 0.11.2 on the H100 failed with the same
# message). Head dim: multiples of 8, up to 256 on Hopper+ (earlier jax: and cuDNN >= 9.5,
# kept here as the stricter), else 128. A bool mask becomes an additive bias that must be
# full [.., N, M] (`check_layout`: "Bias must have same seq length as QKV").
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MIN_VERSION = 8904     # 8.9.4: jax's floor for cuDNN flash attention
# Training needs even lengths: the VJP rule checks `is_training and has_bias and (T or S
# odd)`, and `has_bias` is always true there (an absent bias is a zero-size placeholder),
# so any odd length raises `NotImplementedError: Unsupported sequence length Q 17, KV 17`
# at the first grad. The forward alone would run; we cannot know at the call, so both.
CUDNN_SEQ_MULTIPLE = 2


def padded_length(n: int) -> int:
  """The least length >= ``n`` that cuDNN takes."""
  return -(-n // CUDNN_SEQ_MULTIPLE) * CUDNN_SEQ_MULTIPLE


def cudnn_refusal(q_shape, k_shape, dtype, *, mask_shape=None, backend: str = "gpu",
                  cudnn_version: int | None = None,
                  compute_capability: tuple[int, int] | None = None,
                  padded: bool = False) -> str | None:
  """Why ``jax.nn.dot_product_attention(implementation="cudnn")`` would refuse these
  ``[B, N, H, D]`` inputs (train or eval), or None if it takes them. ``padded``: after
  ``"cudnn_padded"`` pads N and M to :func:`padded_length`. ``cudnn_version`` is cuDNN's
  integer version (9.8.0 -> 90800), None where there is no cuDNN; ``compute_capability``
  the GPU's ``(major, minor)``, None if unknown (then the pre-Hopper head-dim limit)."""
  n, d = q_shape[1], q_shape[3]
  m = k_shape[1]
  if padded:
    n, m = padded_length(n), padded_length(m)
  if backend != "gpu":
    return f"backend {backend!r}: cuDNN runs only on CUDA GPUs"
  if cudnn_version is None:
    return "no cuDNN found on this GPU backend"
  if cudnn_version < CUDNN_MIN_VERSION:
    return f"cuDNN {cudnn_version} is older than {CUDNN_MIN_VERSION}, jax's floor"
  if compute_capability == (10, 3) and cudnn_version < 91100:
    return "compute capability 10.3 needs cuDNN >= 9.11"
  if jnp.dtype(dtype).name not in CUDNN_DTYPES:
    return f"dtype {jnp.dtype(dtype).name} (cuDNN takes {' or '.join(CUDNN_DTYPES)})"
  hopper = compute_capability is not None and tuple(compute_capability) >= (9, 0)
  max_d = 256 if hopper and cudnn_version >= 90500 else 128
  if d % 8 or d > max_d:
    return f"head dim {d} (cuDNN takes multiples of 8 up to {max_d} on this GPU)"
  if mask_shape is not None and tuple(mask_shape[-2:]) != (q_shape[1], k_shape[1]):
    return (f"mask {list(mask_shape)} broadcasts over queries or keys; cuDNN takes a "
            "mask only as a full [.., N, M] bias")
  if n % CUDNN_SEQ_MULTIPLE or m % CUDNN_SEQ_MULTIPLE:
    return (f"sequence length Q {n}, KV {m}: cuDNN's backward takes only multiples of "
            f"{CUDNN_SEQ_MULTIPLE} (jax: 'Unsupported sequence length')")
  return None


# What "auto" runs on a GPU, by the longest sequence length max(N, M): rows of (largest
# length the row covers, None = any; implementation), the first row that covers wins.
#   "as_is": cuDNN takes the shape unpadded.  "paddable": only padded to even lengths.
# Measured by `python -m lowmem_jax.attention_bench` (H100, jax 0.11.2, cuDNN 9.19, bf16,
# ~16k tokens per call, ms forward + backward; docs/gpu/h100-2026-11-25-call2.md):
#   ViT-B   N=17: flash 0.46, cudnn_padded 0.80   N=197: cudnn_padded 0.47, flash 1.07
#           N=577: cudnn_padded 0.60, flash 2.98  N=1024: cudnn 0.62, flash 4.14
#   LLaMA   N=17: flash 1.03, cudnn_padded 1.70   N=197: cudnn_padded 0.96, flash 1.99
#           N=577: cudnn_padded 1.07, flash 5.73  N=2048: cudnn 1.39, flash 11.0
# cuDNN also keeps less (ViT-B N=197: 242 against 517 MiB temp). cudnn_padded at 17 is
# cuDNN at 18 plus pad and slice copies (~0.1 ms by the bytes they move, not timed), so
# short even lengths go to ours too. Between
# N=17 and 197 the crossover is unmeasured: 64 splits the two measured points (the bench
# now times 64 and 129).
AUTO_GPU_TABLE: dict[str, tuple[tuple[int | None, str], ...]] = {
    "as_is": ((64, "flash"), (None, "cudnn")),
    "paddable": ((64, "flash"), (None, "cudnn_padded")),
}


class Choice(NamedTuple):
  implementation: str   # "cudnn", "cudnn_padded" or "flash"
  reason: str           # why not cuDNN on the shape as it is ("" when cuDNN)


def _from_table(kind: str, length: int) -> str:
  return next(impl for limit, impl in AUTO_GPU_TABLE[kind] if limit is None or length <= limit)


def choose_implementation(q_shape, k_shape, dtype, *, backend: str | None = None,
                          causal: bool = False, mask_shape=None,
                          cudnn_version: int | None = None,
                          compute_capability: tuple[int, int] | None = None,
                          dropout_rate: float = 0.0) -> Choice:
  """What ``implementation="auto"`` runs: a pure function of the shapes, dtype, mask,
  backend and cuDNN/GPU version (:func:`cudnn_version`, :func:`compute_capability`
  query them), and whether there is dropout (then ``"flash"``). ``backend=None``: this
  process's (or the compile target's), with its cuDNN version and compute capability.
  Never ``"xla"``: every choice keeps no ``N x M`` array."""
  if dropout_rate > 0:
    return Choice("flash", "attention dropout: cuDNN's is not available through jax's API")
  if backend is None:
    backend, cudnn_version, compute_capability = _platform()
  n, m = q_shape[1], k_shape[1]
  versions = dict(backend=backend, cudnn_version=cudnn_version,
                  compute_capability=compute_capability)
  reason = cudnn_refusal(q_shape, k_shape, dtype, mask_shape=mask_shape, **versions)
  if reason is None and mask_shape is not None:
    reason = "a mask: cuDNN would keep it as an N x M bias for backward"
  if reason is None and causal and n != m:
    reason = f"causal with N {n} != M {m}: cuDNN's causal alignment is not checked here"
  if reason is None:
    implementation = _from_table("as_is", max(n, m))
    return Choice(implementation, "" if implementation == "cudnn" else
                  f"length {max(n, m)}: {implementation} measured faster (AUTO_GPU_TABLE)")
  if mask_shape is None and not (causal and n != m) and cudnn_refusal(
      q_shape, k_shape, dtype, padded=True, **versions) is None:
    return Choice(_from_table("paddable", max(n, m)), reason)
  return Choice("flash", reason)


@functools.lru_cache(maxsize=None)
def _gpu_facts(backend: str) -> tuple[int | None, tuple[int, int] | None]:
  if backend != "gpu":
    return None, None
  try:
    from jax._src.lib import cuda_versions  # None on ROCm and CPU-only builds
    version = None if cuda_versions is None else int(cuda_versions.cudnn_get_version())
  except Exception:  # a private helper: absent or failing means "unknown"
    version = None
  try:
    major, minor = jax.devices("gpu")[0].compute_capability.split(".")[:2]
    capability = (int(major), int(minor))
  except Exception:
    capability = None
  return version, capability


def _platform() -> tuple[str, int | None, tuple[int, int] | None]:
  """(backend, cuDNN version, compute capability) that the dispatch decides for: the
  compile target's (:mod:`lowmem_jax.gpu_target`), else the local backend's."""
  target = gpu_target.platform()
  if target is not None:
    return target
  backend = jax.default_backend()
  return (backend, *_gpu_facts(backend))


def cudnn_version() -> int | None:
  """The loaded cuDNN's version (9.8.0 -> 90800) on a CUDA GPU backend, else None."""
  return _gpu_facts(jax.default_backend())[0]


def compute_capability() -> tuple[int, int] | None:
  """The first GPU's compute capability ``(major, minor)``, None off CUDA GPUs."""
  return _gpu_facts(jax.default_backend())[1]


# ----------------------------------------------------------------------------- padded
def _pad_axis(x, axis, length, value=0):
  if x.shape[axis] == length:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _padded(q, k, v, mask, causal, scale, implementation):
  """``jax.nn.dot_product_attention`` on q, k, v zero-padded to :func:`padded_length`.

  Padded keys are hidden by ``key_value_seq_lengths`` (the kernel's own padding mask, no
  bias array), padded query rows by ``query_seq_lengths`` and sliced off; their
  cotangent is zero, so no gradient reaches q, k, v from them. Saves what
  ``implementation`` saves, at the padded length.
  """
  b, n = q.shape[:2]
  m = k.shape[1]
  n_pad, m_pad = padded_length(n), padded_length(m)
  q = _pad_axis(q, 1, n_pad)
  k, v = _pad_axis(k, 1, m_pad), _pad_axis(v, 1, m_pad)
  if mask is not None:
    mask = _pad_axis(mask, 2, n_pad, False) if mask.shape[2] == n else mask
    mask = _pad_axis(mask, 3, m_pad, False) if mask.shape[3] == m else mask
  out = jax.nn.dot_product_attention(
      q, k, v, mask=mask, scale=scale, is_causal=causal,
      query_seq_lengths=jnp.full((b,), n, jnp.int32),
      key_value_seq_lengths=jnp.full((b,), m, jnp.int32), implementation=implementation)
  return out[:, :n]


# ----------------------------------------------------------------------------- dropout
def _check_dropout_key(key, rate):
  if key is None:
    raise ValueError(f"attention: dropout_rate {rate} needs a dropout_key (a PRNG key: "
                     "jax.random.key(seed)), got None")
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  if not ((typed and shape == ()) or (not typed and dtype == jnp.uint32 and len(shape) == 1)):
    raise ValueError("attention: dropout_key must be one PRNG key (jax.random.key(seed) or "
                     f"jax.random.PRNGKey(seed)), got {dtype}{list(shape or ())}")


def _block_keep(key, j, shape, rate):
  """The keep-mask of key block ``j``: bool ``shape`` ``[B, H, N, block]``,
  :func:`lowmem_jax.dropout.keep_mask` of ``fold_in(key, j)``."""
  return keep_mask(jax.random.fold_in(key, j), shape, rate)


def dropout_keep_mask(key, shape_bhnm, rate: float, block: int):
  """The attention dropout's keep-mask, bool ``[B, H, N, M]`` (True = kept): key block ``j``
  (keys ``j * block`` to ``(j + 1) * block``, the last padded past ``M``) is
  :func:`_block_keep` of ``fold_in(key, j)`` (16-bit draws,
  :func:`lowmem_jax.dropout.keep_mask`); the blocks concatenated along keys, cut to ``M``.
  A function of the key, the shape, ``rate`` and ``block`` only: ``"flash"`` draws it
  block by block with ``block = key_block(M, block_k)``; another ``block_k`` gives another
  mask."""
  b, h, n, m = shape_bhnm
  rate = check_rate(rate, "attention: dropout_rate")
  nb = -(-m // block)
  keep = jax.vmap(lambda j: _block_keep(key, j, (b, h, n, block), rate))(jnp.arange(nb))
  return jnp.moveaxis(keep, 0, 3).reshape(b, h, n, nb * block)[..., :m]


def _xla_dropout(q, k, v, mask, causal, scale, rate, key, block):
  """The reference: softmax, :func:`dropout_keep_mask`, matmul, in plain jnp (what
  ``jax.nn.dot_product_attention(implementation="xla")`` does, with dropout between).
  Autodiff keeps the ``N x M`` probabilities and the mask."""
  b, n, h, d = q.shape
  m, kh = k.shape[1], k.shape[2]
  s = jnp.einsum("bnhgd,bmhd->bhgnm", _grouped(q, kh), k,
                 preferred_element_type=jnp.float32).reshape(b, h, n, m) * scale
  masked = -0.7 * float(jnp.finfo(jnp.float32).max)  # as jax's: a row seeing no key is uniform
  if causal:
    s = jnp.where(jnp.tril(jnp.ones((n, m), bool)), s, masked)
  if mask is not None:
    s = jnp.where(mask, s, masked)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(dropout_keep_mask(key, (b, h, n, m), rate, block), p / (1.0 - rate), 0.0)
  out = jnp.einsum("bhgnm,bmhd->bnhgd", p.reshape(b, kh, h // kh, n, m).astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, n, h, d).astype(q.dtype)


# ----------------------------------------------------------------------------- flash
def key_block(m: int, block_k: int) -> int:
  """The key block of ``"flash"`` for ``m`` keys: at most ``block_k``, in as few blocks as
  that allows, of equal size (197 keys, ``block_k`` 128: two blocks of 99, one padded key)."""
  m = max(m, 1)
  return -(-m // -(-m // block_k))


def _grouped(q, num_kv_heads):
  b, n, h, d = q.shape
  return q.reshape(b, n, num_kv_heads, h // num_kv_heads, d)


def _mask_blocks(mask, num_kv_heads, m, num_blocks, block):
  """Boolean mask -> ``[num_blocks, B', K', G', N', block]`` (broadcast dims kept at 1)."""
  if mask is None:
    return None
  bm, hm, nm, mm = mask.shape
  pad = num_blocks * block - mm if mm == m else 0
  if mm == 1:
    mask = jnp.broadcast_to(mask, (bm, hm, nm, m))
    pad = num_blocks * block - m
  if pad:
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, pad)))
  if hm == 1:
    mask = mask[:, :, None]
  else:
    mask = mask.reshape(bm, num_kv_heads, hm // num_kv_heads, nm, -1)
  mask = mask.reshape(mask.shape[:4] + (num_blocks, block))
  return jnp.moveaxis(mask, 4, 0)


def _key_bias(nb, block, m):
  """``f32[nb, block]``: 0 for the keys of each block, -inf for the padding past ``m``;
  None without padding. Added to the scores: XLA:GPU constant-folded a boolean
  padding mask into an ``N x block`` buffer per head (28 MiB at ViT-B LoRA's peak)."""
  if nb * block == m:
    return None
  return jnp.where(jnp.arange(nb * block) < m, 0.0, -jnp.inf).reshape(nb, block)


def _block_valid(j, block, n, causal, mask_j):
  """Which (query, key) pairs of kv block ``j`` the causal mask and ``mask`` let attend:
  ``[.., N, block]`` bool, or None without either (padded keys: :func:`_key_bias`)."""
  valid = None
  if causal:
    valid = (j * block + jnp.arange(block))[None, :] <= jnp.arange(n)[:, None]
  if mask_j is not None:
    valid = mask_j if valid is None else valid & mask_j
  return valid


def _kv_blocks(x, num_blocks, block):
  b, m, kh, d = x.shape
  pad = num_blocks * block - m
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
  return jnp.moveaxis(x.reshape(b, num_blocks, block, kh, d), 1, 0)


def _scores(qg, kj, scale):
  return jnp.einsum("bnhgd,bkhd->bhgnk", qg, kj,
                    preferred_element_type=jnp.float32) * scale


def _keep_blocks(key, rate, j, b, kh, g, n, block):
  """Block ``j`` of :func:`dropout_keep_mask` as ``[B, K, G, N, block]``; None without
  dropout. Drawn where it is used (forward and backward), never saved."""
  if key is None:
    return None
  return _block_keep(key, j, (b, kh * g, n, block), rate).reshape(b, kh, g, n, block)


def _flash_forward(q, k, v, mask, key, causal, scale, block, rate):
  b, n, h, d = q.shape
  m, kh = k.shape[1], k.shape[2]
  nb = -(-m // block)
  qg = _grouped(q, kh)
  masks = _mask_blocks(mask, kh, m, nb, block)

  def step(carry, xs):
    row_max, row_sum, acc = carry
    j, kj, vj, mask_j, bias_j = xs
    s = _scores(qg, kj, scale)
    s = s if bias_j is None else s + bias_j
    valid = _block_valid(j, block, n, causal, mask_j)
    s = s if valid is None else jnp.where(valid, s, -jnp.inf)
    new_max = jnp.maximum(row_max, s.max(-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    p = jnp.exp(s - safe_max[..., None])
    alpha = jnp.exp(row_max - safe_max)
    row_sum = row_sum * alpha + p.sum(-1)  # the normalizer: of the undropped p
    keep = _keep_blocks(key, rate, j, b, kh, h // kh, n, block)
    p = p if keep is None else jnp.where(keep, p, 0.0)  # 1 / (1 - rate): on acc, at the end
    acc = acc * alpha[..., None] + jnp.einsum(
        "bhgnk,bkhd->bhgnd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
    return (new_max, row_sum, acc), None

  g = h // kh
  init = (jnp.full((b, kh, g, n), -jnp.inf, jnp.float32),
          jnp.zeros((b, kh, g, n), jnp.float32),
          jnp.zeros((b, kh, g, n, d), jnp.float32))
  xs = (jnp.arange(nb), _kv_blocks(k, nb, block), _kv_blocks(v, nb, block), masks,
        _key_bias(nb, block, m))
  (row_max, row_sum, acc), _ = jax.lax.scan(step, init, xs)
  acc = acc if key is None else acc * (1.0 / (1.0 - rate))
  seen = ~(row_sum <= 0)  # a NaN row counts as seen: NaN propagates, as in softmax
  out = jnp.where(seen[..., None], acc / jnp.where(seen, row_sum, 1.0)[..., None], 0.0)
  # +inf for rows that see no key: exp(s - lse) is then 0 in backward.
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), jnp.inf)
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, n, h, d).astype(q.dtype)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _flash(q, k, v, mask, key, causal, scale, block, name, rate):
  return _flash_fwd(q, k, v, mask, key, causal, scale, block, name, rate)[0]


def _flash_fwd(q, k, v, mask, key, causal, scale, block, name, rate):
  out, lse = _flash_forward(q, k, v, mask, key, causal, scale, block, rate)
  out = out if name is None else checkpoint_name(out, name)
  # Residuals: q, k, v, o and the fp32 row log-sum-exp (and the dropout key: backward
  # draws the keep-mask again); never an N x M array.
  return out, (q, k, v, mask, key, out, lse)


def _flash_bwd(causal, scale, block, name, rate, res, do):
  """With dropout (Z the keep-mask, scaled by 1 / (1 - rate)): o = (P * Z) v, so dv =
  (P * Z)^T do, dP = Z * (do v^T), and dS = P * (dP - rowsum(P * dP)) with rowsum(P * dP)
  = rowsum(P * Z * (do v^T)) = rowsum(do * o): the same delta as without dropout."""
  del name
  q, k, v, mask, key, out, lse = res
  b, n, h, d = q.shape
  m, kh = k.shape[1], k.shape[2]
  nb = -(-m // block)
  qg, dog = _grouped(q, kh), _grouped(do, kh)
  delta = jnp.einsum("bnhgd,bnhgd->bhgn", dog.astype(jnp.float32),
                     _grouped(out, kh).astype(jnp.float32))
  masks = _mask_blocks(mask, kh, m, nb, block)

  def step(dq, xs):
    j, kj, vj, mask_j, bias_j = xs
    s = _scores(qg, kj, scale)
    s = s if bias_j is None else s + bias_j
    valid = _block_valid(j, block, n, causal, mask_j)
    p = jnp.exp(s - lse[..., None])
    p = p if valid is None else jnp.where(valid, p, 0.0)
    keep = _keep_blocks(key, rate, j, b, kh, h // kh, n, block)
    dv = jnp.einsum("bhgnk,bnhgd->bkhd",
                    (p if keep is None else jnp.where(keep, p, 0.0)).astype(do.dtype), dog,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("bnhgd,bkhd->bhgnk", dog, vj, preferred_element_type=jnp.float32)
    if keep is not None:
      dv = dv * (1.0 / (1.0 - rate))
      dp = jnp.where(keep, dp * (1.0 / (1.0 - rate)), 0.0)
    ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
    dq = dq + jnp.einsum("bhgnk,bkhd->bnhgd", ds, kj, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgnk,bnhgd->bkhd", ds, qg, preferred_element_type=jnp.float32)
    return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

  xs = (jnp.arange(nb), _kv_blocks(k, nb, block), _kv_blocks(v, nb, block), masks,
        _key_bias(nb, block, m))
  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qg.shape, jnp.float32), xs)

  def unblock(x):
    return jnp.moveaxis(x, 0, 1).reshape(b, nb * block, kh, d)[:, :m]

  return (dq.reshape(b, n, h, d).astype(q.dtype), unblock(dk), unblock(dv), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
