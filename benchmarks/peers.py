"""The PyTorch peers of our fine-tuning step: what users would run instead, same shapes.

    python benchmarks/peers.py --case vit-lora --json vit.json               # ViT-B/16, batch 64
    python benchmarks/peers.py --case vit-lora --checkpointing --json F      # + grad checkpointing
    python benchmarks/peers.py --case llama-lora --json F                    # 4 layers of LLaMA-7B
    python benchmarks/peers.py --case llama-lora --smoke --json F            # tiny shapes (CPU)

One case per process (the allocator's peak is per process). Cases:

- ``vit-lora`` / ``vit-full``: timm ``vit_base_patch16_224`` (pretrained=False; shapes
  overridable) with peft LoRA on our ``--targets`` / full fine-tuning, cross-entropy on
  random images and labels. timm fuses q, k, v in one Linear (``attn.qkv``), and peft adapts
  whole modules: our ``query``, ``key`` or ``value`` map to one adapter on ``qkv`` (A ``D x r``,
  B ``r x 3D``). It has as many parameters as our two adapters on q and v (``r * 4D``) but
  also updates k; what backward keeps is the same up to rank-sized arrays (both adapters
  read the ``x`` the base projection reads; one ``[T, r]`` product where ours keep two).
  ``out`` maps to ``attn.proj``, ``fc1``/``fc2`` to ``mlp.fc1``/``mlp.fc2``.
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

Measured on CUDA: ``resident`` = ``memory_allocated()`` after setup (weights, LoRA, the
batch; AdamW's state is made at the first step and so counts in the peak), then
``reset_peak_memory_stats()`` and ``--warmup`` + ``--steps`` steps; ``peak`` =
``max_memory_allocated()``; step time from CUDA events around each timed step, median.
On CPU the time is the host clock and the peak is None: PyTorch keeps no allocator
statistics for CPU memory, and the process RSS would count the interpreter and libraries.
Prints one line of JSON (also written to ``--json``). A missing package exits with 3 after
one line naming it (and ``{"missing": ...}`` in the JSON file), bad arguments with 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

CASES = {"vit-lora": ("vit", True), "vit-full": ("vit", False),
         "llama-lora": ("llama", True), "llama-full": ("llama", False)}
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


def requirements(case: str) -> list[str]:
  """The packages a case imports: torch, timm (ViT) or transformers (LLaMA), peft (LoRA)."""
  family, lora = CASES[case]
  return ["torch", "timm" if family == "vit" else "transformers"] + (["peft"] if lora else [])


def missing_package(case: str) -> str | None:
  """The first of the case's packages that does not import, with why (timm, e.g., needs
  torchvision); None when all do."""
  for name in requirements(case):
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
  targets = [t.strip() for t in (args.targets or DEFAULT_TARGETS[family]).split(",")
             if t.strip()]
  unknown = [t for t in targets if t not in TARGET_MODULES[family]]
  if lora and (unknown or not targets):
    ap.error(f"--targets: {', '.join(unknown) or 'none given'} not among the {family} "
             f"linears {', '.join(TARGET_MODULES[family])}")
  if not lora and args.targets:
    ap.error(f"--targets applies to LoRA cases, not {args.case}")
  args.family, args.lora, args.shapes = family, lora, shapes
  args.targets = targets if lora else []
  return args


# ----------------------------------------------------------------------------- models
def build_vit(args, device):
  """timm's ViT-B/16 with our shapes; the step's loss on one random batch."""
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
  model = _with_lora(model, args, r"blocks\.\d+\.(" + "|".join(modules) + ")")
  model.to(device).train()
  g = torch.Generator(device="cpu").manual_seed(args.seed)
  images = torch.randn(s["batch"], s["channels"], s["image_size"], s["image_size"],
                       generator=g).to(device)
  labels = torch.randint(0, s["num_classes"], (s["batch"],), generator=g).to(device)
  return model, lambda: F.cross_entropy(model(images).float(), labels), s["batch"]


def build_llama(args, device):
  """HF ``LlamaForCausalLM`` from a config (built on the device); next-token loss."""
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
  with torch.device(device):  # fp32 weights, initialised where they will live
    model = LlamaForCausalLM(config)
  model.train()
  if args.checkpointing:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
      model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
      model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
  model = _with_lora(model, args, sorted(TARGET_MODULES["llama"][t] for t in args.targets))
  g = torch.Generator(device="cpu").manual_seed(args.seed)
  tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=g).to(device)
  inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

  def loss():
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
  return model, loss, s["batch"] * s["seq"]


def _with_lora(model, args, target_modules):
  """peft LoRA (dropout 0, no bias) on ``target_modules`` when the case is LoRA, else
  the model itself (every parameter trains)."""
  if not args.lora:
    return model
  import peft
  config = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                           bias="none", target_modules=target_modules)
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
  model, loss_fn, items = build(args, device)
  params = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
  dtype = getattr(torch, args.dtype)
  autocast = torch.autocast(device.type, dtype=dtype, enabled=args.dtype != "float32")

  def step():
    with autocast:
      loss = loss_fn()
    loss.backward()
    if args.grad_clip:
      torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()

  resident = None
  if cuda:
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
  for _ in range(args.warmup):
    loss = step()
  times = []
  for _ in range(args.steps):
    if cuda:
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      loss = step()
      end.record()
      times.append((start, end))
    else:
      t0 = time.perf_counter()
      loss = step()
      times.append(time.perf_counter() - t0)
  if cuda:
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / 1e3 for s, e in times]
  loss = float(loss)
  seconds = statistics.median(times)
  peak = torch.cuda.max_memory_allocated() if cuda else None
  with autocast:  # after the peak is read: which trainable tensors get a nonzero gradient
    loss_fn().backward()
  with_grad = sum(p.grad is not None and bool(p.grad.any()) for p in params)
  mib = lambda b: None if b is None else b / 2**20  # noqa: E731
  return {
      "case": args.case, "checkpointing": args.checkpointing, "lora": args.lora,
      "targets": args.targets, "rank": args.rank if args.lora else None,
      "alpha": args.alpha if args.lora else None, "dtype": args.dtype,
      "shapes": args.shapes, "warmup_steps": args.warmup, "timed_steps": args.steps,
      "device": device.type,
      "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
      "versions": _versions(args.case),
      "trainable_params": sum(p.numel() for p in params),
      "trainable_tensors": len(params), "tensors_with_gradient": with_grad,
      "total_params": sum(p.numel() for p in model.parameters()),
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
  }


def _versions(case: str) -> dict:
  return {name: getattr(sys.modules.get(name), "__version__", None)
          for name in requirements(case)}


def main(argv=None) -> dict:
  args = parse_args(argv)
  missing = missing_package(args.case)
  if missing:
    print(f"peers: {args.case} needs {missing}, which is not importable "
          "(pip install lowmem-jax[peers])", file=sys.stderr)
    if args.json:
      Path(args.json).write_text(json.dumps({"case": args.case, "missing": missing}))
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
