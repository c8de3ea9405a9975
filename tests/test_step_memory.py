"""Guards the compiled memory of full training steps measured for the closing figures
(CPU, jax 0.10.2; docs/step_memory_*_cpu.json): lowmembp vs baseline."""

import pytest

from conftest import cli_error
from models import step_memory
from jax_versions import skip_unless_cpu_bounds_hold


# Per compiler: (compiled temp ratio, saved-residual ratio) lowmembp / lean baseline that
# a backend must beat. CPU (jax 0.10.2, a073a36+): vit-b16 batch 64 temp 8243.1 -> 5380.7
# MiB (0.653), saved 3572.9 -> 2355.0 MiB (0.659); llama-7b 2 layers 4 x 512 temp 2862.3 ->
# 2673.3 MiB (0.934), saved 796.8 -> 716.8 MiB (0.900: only MS-RMSNorm saves; the gated
# SiLU stays exact). Plain autodiff (``plain``, XLA attention): vit 15818.5 / 8895.2 MiB,
# llama 5455.6 / 2861.4 MiB. GPU: not yet measured for these steps; lowmembp must not cost
# more there. Saved residuals are jaxpr-level (the same on every backend once the
# attention path is fixed: flash here).
RATIOS = {
    "cpu": {"vit-b16": (0.67, 0.67), "llama-7b-2l": (0.95, 0.92)},
    "gpu": {"vit-b16": (1.0, 0.67), "llama-7b-2l": (1.0, 0.92)},
}


@pytest.mark.slow
@pytest.mark.precision("default")
@pytest.mark.parametrize("model,overrides,batch,seq", [
    ("vit-b16", {}, 64, 0), ("llama-7b", {"num_layers": 2}, 4, 512),
], ids=["vit-b16", "llama-7b-2l"])
def test_lowmembp_step_memory_vs_baseline(request, model, overrides, batch, seq):
  import jax
  import jax.numpy as jnp
  backend = jax.default_backend()
  if backend not in RATIOS:
    pytest.skip(f"no compiled-memory figure for the {backend} compiler")
  skip_unless_cpu_bounds_hold(backend)
  temp_ratio, residual_ratio = RATIOS[backend][request.node.callspec.id]
  rows = step_memory.measure(model, ["baseline+attention=flash", "lowmembp+attention=flash"],
                             batch, seq, jnp.bfloat16, overrides)
  base, low = rows
  if temp_ratio < 1.0:
    assert low["compiled"]["temp"] < temp_ratio * base["compiled"]["temp"], (backend, rows)
  else:
    assert low["compiled"]["temp"] <= base["compiled"]["temp"], (backend, rows)
  assert low["saved_residual_bytes"] < residual_ratio * base["saved_residual_bytes"], rows


def test_unknown_model_and_bad_override():
  with pytest.raises(ValueError, match="unknown model"):
    step_memory.build("gpt-2", "baseline", None, {})
  with pytest.raises(ValueError, match="key=value"):
    step_memory._overrides(["num_layers"])


@pytest.mark.precision("default")
def test_the_vit_step_keeps_no_n_by_n_buffer():
  """The whole ViT train step, read off the compiled executable (peak_buffers): plain
  autodiff with XLA's attention keeps every layer's fp32 N x N probabilities at the peak;
  the lean baseline (flash attention) at most the scores of the one block being worked on
  (N = 17 is below its 512-key block), never a layer-stacked one."""
  import jax.numpy as jnp
  batch, n, layers, heads = 4, 17, 2, 4  # vit-tiny: 32 px, patch 8 -> 16 patches + CLS
  one_layer = batch * heads * n * n * 4
  square = {}
  for spec in ("plain", "baseline"):
    peak = step_memory.explain("vit-tiny", spec, batch, 0, jnp.bfloat16, {})
    square[spec] = sum(b.nbytes for b in peak.find(dtype="float32") if b.shape[-2:] == (n, n))
  assert square["plain"] >= layers * one_layer, square
  assert square["baseline"] <= one_layer, square
  # nearly all of the peak's temporaries are traced to a Python source line
  located = sum(b.nbytes for b in peak.find(kind="temp") if ".py:" in b.source)
  assert located >= 0.9 * peak.bytes_of("temp")


@pytest.mark.precision("default")
def test_explain_prints_the_peak_buffers_by_source_line(capsys, tmp_path):
  result = step_memory.main(["--model", "vit-tiny", "--batch", "2", "--policies", "baseline",
                             "--explain", "--top", "5", "--json", str(tmp_path / "m.json")])
  out = capsys.readouterr().out
  assert "[baseline] live at the peak of" in out and "by source line:" in out
  row = result["rows"][0]["peak_buffers"]
  assert row["peak_bytes"] > 0 and len(row["by_source"]) == 5
  assert (tmp_path / "m.json").exists()


def _no_work(*args, **kwargs):
  raise AssertionError("compiled before checking the arguments")


BAD_ARGS = [
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--seq", "0"], "--seq must be >= 1, got 0"),
    (["--top", "0", "--explain"], "--top must be >= 1, got 0"),
    (["--dtype", "foo"], "argument --dtype: invalid choice: 'foo' (choose from "),
    (["--model", "nope"], "--model: unknown model 'nope'; valid presets: vit-ti16, "),
    (["--set", "nope=1"], "--set: unknown ViTConfig field(s) nope; valid: "),
    (["--set", "num_layers=0"], "--set: ViTConfig: num_layers must be a positive int, got 0"),
    (["--set", "num_layers"], "--set: expects key=value, got 'num_layers'"),
    (["--model", "llama-tiny", "--seq", "300"], "--seq 300 exceeds the 256 positions of "
     "llama-tiny"),
    (["--policies", ","], "--policies: names no policy, got ','"),
    (["--model", "llama-tiny", "--seq", "8", "--policies", "baseline,reversible=pareprop"],
     "--policies: reversible=pareprop: Llama: policy 'pareprop' needs a reversible "
     "architecture"),
    (["--json", "{tmp}"], "--json {tmp} is a directory; give a file name"),
    (["--json", "{tmp}/no/m.json"], "--json {tmp}/no/m.json: the directory {tmp}/no does not "
     "exist"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_are_one_line_errors_before_any_compile(argv, message, tmp_path, capsys,
                                                              monkeypatch):
  monkeypatch.setattr(step_memory, "measure", _no_work)
  argv = ["--model", "vit-tiny", "--policies", "baseline"] + [
      a.format(tmp=tmp_path) for a in argv]
  assert cli_error(step_memory.main, argv, capsys).startswith(message.format(tmp=tmp_path))
  assert list(tmp_path.iterdir()) == []


def test_ratios_are_to_baseline_wherever_it_is_listed(capsys):
  """The ratios divided by the first policy listed, under a header that said baseline."""
  rows = step_memory.main(["--model", "vit-tiny", "--batch", "2",
                           "--policies", "remat,baseline"])["rows"]
  out = capsys.readouterr().out
  assert "ratios to baseline" in out
  lines = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
  assert lines["baseline"][2] == "1.000"
  remat, base = (r["compiled"]["temp"] for r in rows)
  assert lines["remat"][2] == f"{remat / base:.3f}" != "1.000"
