r"""The PyTorch peers of our fine-tuning step: what users would run instead, same shapes.

    python benchmarks/peers.py --case vit-lora --json vit.json               # ViT-B/16, batch 64
    python benchmarks/peers.py --case vit-lora --checkpointing --json F      # + grad checkpointing
    python benchmarks/peers.py --case llama-lora --json F                    # 4 layers of LLaMA-7B
    python benchmarks/peers.py --case llama-lora --smoke --json F            # tiny shapes (CPU)
    python benchmarks/peers.py --case llama-lora --layers 32 --seq 2048 --base-dtype bfloat16 \
        --find-max-batch --json F                                            # 7B: the largest batch

One case per process (the allocator's peak is per process). Cases:

- ``vit-lora`` / ``vit-full``: timm ``vit_base_patch16_224`` (pretrained=False; shapes
  overridable) with peft LoRA on our ``--targets`` / full fine-tuning, cross-entropy on
  random images and labels. timm fuses q, k, v in one Linear (``attn.qkv``), and peft adapts
  whole modules: our ``query``, ``key`` or ``value`` map to one adapter on ``qkv`` (A ``D x r``,
  B ``r x 3D``). It has as many parameters as our two adapters on q and v (``r * 4D``) but
  also updates k; what backward keeps is the same up to rank-sized arrays (both adapters
  read the ``x`` the base projection reads; one ``[T, r]`` product where ours keep two).
  ``out`` maps to ``attn.proj``, ``fc1``/``fc2`` to ``mlp.fc1``/``mlp.fc2``. The
  classifier ``head`` trains in full (peft's ``modules_to_save``), as ours does under LoRA.
- ``llama-lora`` / ``llama-full``: HF ``LlamaForCausalLM`` from a ``LlamaConfig`` (no
  download; default 4 layers of LLaMA-7B widths, batch 4 x 1024), peft LoRA on
  ``q,k,v,o,gate,up,down`` (our ``query,key,value,out,gate,up,down``), next-token
  cross-entropy on fp32 logits (as HF's own loss) of random tokens.

The step, for all: fp32 weights, ``torch.autocast`` in ``--dtype`` (bf16 default; fp32: none),
SDPA attention, ``clip_grad_norm_(--grad-clip)``, ``torch.optim.AdamW`` (lr 1e-3, weight
decay 0.05: our config's defaults; they change values, not memory or time), ``zero_grad``
to None. ``--checkpointing``: timm ``set_grad_checkpointing(True)``, HF
``gradient_checkpointing`` with ``use_reentrant=False``, every block. One random batch is
made on the device at setup and reused by every step (LoRA's B starts at zero, as ours).

``--base-dtype`` (``llama-lora``): the weights the model is built with. ``float32`` (default)
as above; ``bfloat16``: the whole model built in bf16 (as ``torch_dtype=torch.bfloat16``
loads it: embeddings, norms and head too; no fp32 copy is made), peft's adapters fp32
(its default ``autocast_adapter_dtype``); ``nf4`` (LoRA only): that bf16 model with every
decoder linear replaced by bitsandbytes' ``Linear4bit`` (NF4, bf16 compute, no double
quantization: QLoRA's setup, as our ``base_dtype=nf4``), the head left bf16; needs
bitsandbytes (missing: exit 3 naming it, as for any package).

``--find-max-batch``: the largest batch (at most ``--max-batch``) that runs two steps
without ``torch.cuda.OutOfMemoryError``, found by trying batches in one process
(``benchmarks.fit_search.largest_fitting``: doubling from 1, then the bracket narrowed,
with each try's allocator peak; memory freed after an out-of-memory), then timed at that
batch as below; the result's ``find_max_batch`` has the tries. On CPU nothing runs out of
memory: the cap is the answer.

Measured on CUDA: ``resident`` = ``memory_allocated()`` after setup (weights, LoRA, the
batch; AdamW's state is made at the first step and so counts in the peak), then
``reset_peak_memory_stats()`` and ``--warmup`` + ``--steps`` steps; ``peak`` =
``max_memory_allocated()``; step time from CUDA events around each timed step, median.
On CPU the time is the host clock and the peak is None: PyTorch keeps no allocator
statistics for CPU memory, and the process RSS would count the interpreter and libraries.
``--profile`` (CUDA): then up to 5 more steps under ``torch.profiler``; the result's
``profile`` is their device time by kernel kind (``train.kernel_time.summarize``, as our
bench's ``--profile``). Prints one line of JSON (also written to ``--json``). A missing
package exits with 3 after one line naming it (and ``{"missing": ...}`` in the JSON
file), bad arguments with 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

CASES = {"vit-lora": ("vit", True), "vit-full": ("vit", False),
         "llama-lora": ("llama", True), "llama-full": ("llama", False)}
BASE_DTYPES = ("float32", "bfloat16", "nf4")
BASE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
EXIT_MISSING = 3

# shape flags per family: full size (the GPU check's shapes) and --smoke (tiny, CPU)
SHAPES = {
    "vit": {"image_size": 224, "patch_size": 16, "channels": 3, "dim": 768, "layers": 12,
            "heads": 12, "mlp_dim": 3072, "num_classes": 1000, "batch": 64},
    "llama": {"vocab": 32000, "dim": 4096, "layers": 4, "heads": 32, "kv_heads": 32,
              "head_dim": None, "mlp_dim": 11008, "seq": 1024, "batch": 4},
}
SMOKE_SHAPES = {
    "vit": {"image_size": 32, "patch_size": 8, "channels": 3, "dim": 64, "layers": 2,
            "heads": 4, "mlp_dim": 128, "num_classes": 10, "batch": 2},
    "llama": {"vocab": 256, "dim": 64, "layers": 2, "heads": 4, "kv_heads": 4,
              "head_dim": None, "mlp_dim": 176, "seq": 32, "batch": 2},
}
SHAPE_KEYS = list(dict.fromkeys([*SHAPES["vit"], *SHAPES["llama"]]))
DEFAULT_TARGETS = {"vit": "query,value", "llama": "query,key,value,out,gate,up,down"}
# our linear names -> the peer's module names (peft matches a regex on the full name)
TARGET_MODULES = {
    "vit": {"query": r"attn\.qkv", "key": r"attn\.qkv", "value": r"attn\.qkv",
            "out": r"attn\.proj", "fc1": r"mlp\.fc1", "fc2": r"mlp\.fc2"},
    "llama": {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "o_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}
LR, WEIGHT_DECAY = 1e-3, 0.05


def requirements(case: str, base_dtype: str = "float32") -> list[str]:
  """The packages a case imports: torch, timm (ViT) or transformers (LLaMA), peft (LoRA),
  bitsandbytes (an nf4 base)."""
  family, lora = CASES[case]
  return (["torch"] + (["bitsandbytes"] if base_dtype == "nf4" else [])  # it needs torch
          + ["timm" if family == "vit" else "transformers"] + (["peft"] if lora else []))


def install_hint(missing: str) -> str:
  """The pip command that provides ``missing`` (as :func:`missing_package` says it):
  bitsandbytes and torchvision are not in the ``peers`` extra (each must match the
  torch build)."""
  needed = missing.split("(needs ")[-1].rstrip(")")
  if needed in ("bitsandbytes", "torchvision"):
    return f"pip install {needed}, built for the installed torch"
  return "pip install 'lowmem-jax[peers]'"


def missing_package(case: str, base_dtype: str = "float32") -> str | None:
  """The first of the case's packages that does not import, with why (timm, e.g., needs
  torchvision); None when all do."""
  for name in requirements(case, base_dtype):
    try:
      importlib.import_module(name)
    except ImportError as e:
      return name if e.name in (None, name) else f"{name} (needs {e.name})"
  return None


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
  """The namespace, with ``shapes`` resolved: the family's defaults (``--smoke``: tiny),
  then the flags given. Bad values exit 2 with a line naming the flag."""
  ap = argparse.ArgumentParser(prog="python benchmarks/peers.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--case", required=True, choices=list(CASES))
  ap.add_argument("--checkpointing", action="store_true",
                  help="gradient checkpointing of every block (non-reentrant)")
  ap.add_argument("--json", metavar="FILE", help="write the result as JSON")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny default shapes, 1 warmup and 2 timed steps (a CPU check)")
  ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                  help="auto: cuda when available (default)")
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                  help="autocast dtype; float32: no autocast (default: %(default)s)")
  ap.add_argument("--warmup", type=int, help="untimed steps first (default 3; --smoke 1)")
  ap.add_argument("--steps", type=int, help="timed steps (default 15; --smoke 2)")
  ap.add_argument("--rank", type=int, default=8, help="LoRA rank (default: %(default)s)")
  ap.add_argument("--alpha", type=float, default=16.0,
                  help="LoRA alpha (default: %(default)s, our config's lora_alpha)")
  ap.add_argument("--targets", help="LoRA targets in our names (default: vit "
                  f"{DEFAULT_TARGETS['vit']}; llama {DEFAULT_TARGETS['llama']})")
  ap.add_argument("--grad-clip", type=float, default=1.0,
                  help="global-norm clip, 0: none (default: %(default)s, as our config)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--base-dtype", default="float32",
                  type=lambda v: BASE_ALIASES.get(v, v), choices=BASE_DTYPES,
                  help="llama cases: the weights' dtype (bf16, fp32 also accepted; nf4: "
                       "LoRA only, needs bitsandbytes; default: %(default)s)")
  ap.add_argument("--profile", action="store_true",
                  help="after timing, trace up to 5 more steps (torch.profiler, CUDA) and "
                       "break their device time down by kernel kind (train.kernel_time)")
  ap.add_argument("--find-max-batch", action="store_true",
                  help="the largest batch that runs (out of memory caught), then timed there")
  ap.add_argument("--max-batch", type=int, default=256,
                  help="--find-max-batch: the largest batch tried (default: %(default)s)")
  for key in SHAPE_KEYS:
    ap.add_argument("--" + key.replace("_", "-"), type=int, dest=key,
                    help=f"{' and '.join(f for f in SHAPES if key in SHAPES[f])} shape")
  args = ap.parse_args(argv)

  family, lora = CASES[args.case]
  shapes = dict((SMOKE_SHAPES if args.smoke else SHAPES)[family])
  for key in SHAPE_KEYS:
    value = getattr(args, key)
    if value is None:
      continue
    if key not in shapes:
      other = "llama" if family == "vit" else "vit"
      ap.error(f"--{key.replace('_', '-')} applies to {other} cases, not {args.case}")
    if value < 1:
      ap.error(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    shapes[key] = value
  if family == "vit" and shapes["image_size"] % shapes["patch_size"]:
    ap.error(f"--image-size {shapes['image_size']} is not a multiple of --patch-size "
             f"{shapes['patch_size']}")
  if shapes["dim"] % shapes["heads"] and shapes.get("head_dim") is None:
    ap.error(f"--dim {shapes['dim']} is not divisible by --heads {shapes['heads']}")
  if family == "llama" and shapes["heads"] % shapes["kv_heads"]:
    ap.error(f"--heads {shapes['heads']} is not a multiple of --kv-heads {shapes['kv_heads']}")
  args.warmup = (1 if args.smoke else 3) if args.warmup is None else args.warmup
  args.steps = (2 if args.smoke else 15) if args.steps is None else args.steps
  if args.warmup < 0 or args.steps < 1:
    ap.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
  if args.rank < 1:
    ap.error(f"--rank must be >= 1, got {args.rank}")
  if args.json:  # before the measurement, not after it (no jax here: cli_checks imports it)
    parent = Path(args.json).resolve().parent
    if Path(args.json).is_dir() or not parent.is_dir():
      ap.error(f"--json {args.json}: not a file in an existing directory")
  targets = [t.strip() for t in (args.targets or DEFAULT_TARGETS[family]).split(",")
             if t.strip()]
  unknown = [t for t in targets if t not in TARGET_MODULES[family]]
  if lora and (unknown or not targets):
    ap.error(f"--targets: {', '.join(unknown) or 'none given'} not among the {family} "
             f"linears {', '.join(TARGET_MODULES[family])}")
  if not lora and args.targets:
    ap.error(f"--targets applies to LoRA cases, not {args.case}")
  if args.base_dtype != "float32" and args.case != "llama-lora":
    ap.error(f"--base-dtype {args.base_dtype} applies to llama-lora (a frozen base), not "
             f"{args.case}")
  if args.max_batch < 1:
    ap.error(f"--max-batch must be >= 1, got {args.max_batch}")
  args.family, args.lora, args.shapes = family, lora, shapes
  args.targets = targets if lora else []
  return args


# ----------------------------------------------------------------------------- models
def build_vit(args, device):
  """timm's ViT-B/16 with our shapes; ``batch_loss(batch)``: the step's loss on one random
  batch of that size (made once, on the device) and the examples in it."""
  import timm
  import torch
  import torch.nn.functional as F

  s = args.shapes
  model = timm.create_model(
      "vit_base_patch16_224", pretrained=False, num_classes=s["num_classes"],
      img_size=s["image_size"], patch_size=s["patch_size"], in_chans=s["channels"],
      embed_dim=s["dim"], depth=s["layers"], num_heads=s["heads"],
      mlp_ratio=s["mlp_dim"] / s["dim"])
  if args.checkpointing:
    set_reentrant = getattr(timm.layers, "set_reentrant_ckpt", None)
    if set_reentrant is not None:  # newer timm (off by default); older timm uses torch's
      set_reentrant(False)         # default, reentrant: LoRA's backward then fails loudly
    model.set_grad_checkpointing(True)
  modules = sorted({TARGET_MODULES["vit"][t] for t in args.targets})
  model = _with_lora(model, args, r"blocks\.\d+\.(" + "|".join(modules) + ")",
                     modules_to_save=["head"])
  model.to(device).train()

  def batch_loss(batch):
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    images = torch.randn(batch, s["channels"], s["image_size"], s["image_size"],
                         generator=g).to(device)
    labels = torch.randint(0, s["num_classes"], (batch,), generator=g).to(device)
    return lambda: F.cross_entropy(model(images).float(), labels), batch
  return model, batch_loss


def build_llama(args, device):
  """HF ``LlamaForCausalLM`` from a config, built on the device in ``--base-dtype`` (nf4:
  bf16, then its decoder linears quantized); ``batch_loss(batch)``: the next-token loss on
  one random batch of that size and the tokens in it."""
  import torch
  import torch.nn.functional as F
  from transformers import LlamaConfig, LlamaForCausalLM

  s = args.shapes
  config = LlamaConfig(
      vocab_size=s["vocab"], hidden_size=s["dim"], intermediate_size=s["mlp_dim"],
      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"] or s["dim"] // s["heads"],
      max_position_embeddings=max(s["seq"], 2048), tie_word_embeddings=False,
      use_cache=False, attn_implementation="sdpa")
  default = torch.get_default_dtype()
  # the weights made in their dtype where they will live (as torch_dtype= loads them)
  torch.set_default_dtype(torch.float32 if args.base_dtype == "float32" else torch.bfloat16)
  try:
    with torch.device(device):
      model = LlamaForCausalLM(config)
  finally:
    torch.set_default_dtype(default)
  if args.base_dtype == "nf4":
    _quantize_nf4(model, device)
    # what from_pretrained(quantization_config=...) sets: peft then wraps the layers in its
    # QLoRA bnb.Linear4bit, not its generic Linear
    model.is_loaded_in_4bit = True
  model.train()
  if args.checkpointing:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
      model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
      model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
  model = _with_lora(model, args, sorted(TARGET_MODULES["llama"][t] for t in args.targets))

  def batch_loss(batch):
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    tokens = torch.randint(0, s["vocab"], (batch, s["seq"] + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss():
      logits = model(input_ids=inputs, use_cache=False).logits
      return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return loss, batch * s["seq"]
  return model, batch_loss


def _quantize_nf4(model, device) -> None:
  """Every ``nn.Linear`` of the decoder layers (not the head) replaced, in place, by a
  bitsandbytes ``Linear4bit`` holding its weight in NF4 (quantized on the device)."""
  import bitsandbytes as bnb
  import torch

  for layer in model.model.layers:
    for parent in list(layer.modules()):
      for name, child in list(parent.named_children()):
        if type(child) is not torch.nn.Linear:
          continue
        quantized = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                      bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=False,
                                      quant_type="nf4", device="meta")
        quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                             compress_statistics=False, quant_type="nf4")
        if child.bias is not None:
          quantized.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
        setattr(parent, name, quantized.to(device))
  if torch.device(device).type == "cuda":
    torch.cuda.empty_cache()  # the bf16 weights' blocks back to the driver


def _with_lora(model, args, target_modules, modules_to_save=None):
  """peft LoRA (dropout 0, no bias) on ``target_modules`` when the case is LoRA, with
  ``modules_to_save`` trained in full (the classifier head, as ours under LoRA), else
  the model itself (every parameter trains)."""
  if not args.lora:
    return model
  import peft
  config = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                           bias="none", target_modules=target_modules,
                           modules_to_save=modules_to_save)
  return peft.get_peft_model(model, config)


# ----------------------------------------------------------------------------- the step
def measure(args) -> dict:
  """Builds the case, runs ``warmup`` + ``steps`` steps; memory, times and the loss."""
  import torch

  torch.manual_seed(args.seed)
  name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
      else args.device
  if name == "cuda" and not torch.cuda.is_available():
    raise ValueError("--device cuda: torch.cuda.is_available() is False")
  device = torch.device(name)
  cuda = device.type == "cuda"
  build = build_vit if args.family == "vit" else build_llama
  model, batch_loss = build(args, device)
  params = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
  dtype = getattr(torch, args.dtype)
  autocast = torch.autocast(device.type, dtype=dtype, enabled=args.dtype != "float32")

  def step(loss_fn):
    with autocast:
      loss = loss_fn()
    loss.backward()
    if args.grad_clip:
      torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()

  search = None
  if args.find_max_batch:
    search = find_max_batch(args, batch_loss, step, optimizer, cuda)
    if search["max_batch"] == 0:
      return {"case": args.case, "base_dtype": args.base_dtype, "shapes": args.shapes,
              "find_max_batch": search, "device": device.type,
              "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
              "versions": _versions(args.case, args.base_dtype)}
    args.shapes = {**args.shapes, "batch": search["max_batch"]}
  loss_fn, items = batch_loss(args.shapes["batch"])

  resident = None
  if cuda:
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
  for _ in range(args.warmup):
    loss = step(loss_fn)
  times = []
  for _ in range(args.steps):
    if cuda:
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      loss = step(loss_fn)
      end.record()
      times.append((start, end))
    else:
      t0 = time.perf_counter()
      loss = step(loss_fn)
      times.append(time.perf_counter() - t0)
  if cuda:
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / 1e3 for s, e in times]
  loss = float(loss)
  seconds = statistics.median(times)
  peak = torch.cuda.max_memory_allocated() if cuda else None
  traced = None
  if args.profile and cuda:
    try:  # after the timed steps: a trace that fails costs its figures, not the run's
      traced = profile_steps(args.steps, lambda: step(loss_fn))
    except Exception as e:  # noqa: BLE001 - any profiler failure (no CUPTI, ...)
      print(f"warning: --profile failed: {type(e).__name__}: {e}", file=sys.stderr)
  with autocast:  # after the peak is read: which trainable tensors get a nonzero gradient
    loss_fn().backward()
  with_grad = sum(p.grad is not None and bool(p.grad.any()) for p in params)
  mib = lambda b: None if b is None else b / 2**20  # noqa: E731
  return {
      "case": args.case, "checkpointing": args.checkpointing, "lora": args.lora,
      "targets": args.targets, "rank": args.rank if args.lora else None,
      "base_dtype": args.base_dtype,
      "adapter_dtype": str(params[0].dtype).replace("torch.", "") if args.lora else None,
      "find_max_batch": search,
      "alpha": args.alpha if args.lora else None, "dtype": args.dtype,
      "shapes": args.shapes, "warmup_steps": args.warmup, "timed_steps": args.steps,
      "device": device.type,
      "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
      "versions": _versions(args.case, args.base_dtype),
      "trainable_params": sum(p.numel() for p in params),
      "trainable_tensors": len(params), "tensors_with_gradient": with_grad,
      "total_params": sum(p.numel() for p in model.parameters()),
      "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
      "timing": "cuda events" if cuda else "host clock",
      "step_ms": seconds * 1e3, "step_ms_all": [t * 1e3 for t in times],
      "items_per_step": items, "throughput": items / seconds,
      "throughput_unit": "tokens/s" if args.family == "llama" else "examples/s",
      "resident_bytes": resident, "peak_bytes": peak,
      "peak_minus_resident_bytes": None if peak is None else peak - resident,
      "resident_mib": mib(resident), "peak_mib": mib(peak),
      "peak_minus_resident_mib": None if peak is None else mib(peak - resident),
      "peak_note": None if cuda else (
          "no peak on CPU: torch keeps allocator statistics for CUDA only"),
      "final_loss": loss, "finite": loss == loss and abs(loss) != float("inf"),
      "profile": traced,
  }


def profile_steps(steps: int, step) -> dict:
  """``steps`` calls of ``step`` (at most ``PROFILE_STEPS``, as our bench's ``--profile``)
  under ``torch.profiler`` (CUDA activity), waited for: ``train.kernel_time.summarize``
  of their kernels."""
  import torch
  from torch.profiler import ProfilerActivity, profile
  _repo_on_path()
  from train.kernel_time import PROFILE_STEPS, summarize, torch_kernels

  steps = min(steps, PROFILE_STEPS)
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    start = time.perf_counter()
    for _ in range(steps):
      step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
  return summarize(torch_kernels(prof.events()), steps, wall)


def _repo_on_path() -> None:
  """Run as a script, benchmarks/ is on the path, not the repo root: put the root there."""
  root = str(Path(__file__).resolve().parents[1])
  if root not in sys.path:
    sys.path.insert(0, root)


def _versions(case: str, base_dtype: str) -> dict:
  return {name: getattr(sys.modules.get(name), "__version__", None)
          for name in requirements(case, base_dtype)}


def find_max_batch(args, batch_loss, step, optimizer, cuda: bool) -> dict:
  """The largest batch up to ``--max-batch`` whose two steps run without running out of
  CUDA memory (module docstring): ``{"max_batch", "capped", "tries": [[batch, peak bytes
  or None: out of memory], ...], "cap"}``. On CPU every batch "fits" (no peak)."""
  import gc

  import torch
  _repo_on_path()
  from benchmarks.fit_search import largest_fitting

  def peak_of(batch: int) -> float:
    loss_fn = batch_loss(batch)[0]
    if cuda:
      torch.cuda.synchronize()
      torch.cuda.reset_peak_memory_stats()
    try:
      for _ in range(2):
        step(loss_fn)
      if cuda:
        torch.cuda.synchronize()
      oom = False
    except torch.cuda.OutOfMemoryError:
      oom = True
    optimizer.zero_grad(set_to_none=True)
    del loss_fn
    gc.collect()
    if cuda:
      torch.cuda.empty_cache()
    peak = math.inf if oom else (torch.cuda.max_memory_allocated() if cuda else 0)
    print(f"  batch {batch}: " + ("out of memory" if oom else f"peak {peak / 2**20:.0f} MiB"),
          file=sys.stderr, flush=True)
    return peak
  budget = torch.cuda.get_device_properties(0).total_memory if cuda else math.inf
  found = largest_fitting(peak_of, budget, args.max_batch)
  return {"max_batch": found.best, "capped": found.capped, "cap": args.max_batch,
          "tries": [[b, None if math.isinf(p) else p] for b, p in found.tried]}


def main(argv=None) -> dict:
  args = parse_args(argv)
  missing = missing_package(args.case, args.base_dtype)
  if missing:
    print(f"peers: {args.case} needs {missing}, which is not importable "
          f"({install_hint(missing)})", file=sys.stderr)
    if args.json:
      Path(args.json).write_text(json.dumps({"case": args.case, "missing": missing,
                                             "install": install_hint(missing)}))
    sys.exit(EXIT_MISSING)
  try:
    result = measure(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=2))
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
