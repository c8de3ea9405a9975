"""Memory tools: compiled step memory, saved residuals, and the report CLI."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import cli_error
from lowmem_jax import memory
from lowmem_jax.block_stack import StackConfig
from lowmem_jax.policy import MemoryPolicy


def test_step_memory_fields_and_total():
  x = jnp.ones((256, 256), jnp.float32)
  mem = memory.step_memory(lambda x: jnp.tanh(x @ x) @ x, x)
  assert mem.argument == 256 * 256 * 4
  assert mem.output == 256 * 256 * 4
  assert mem.temp >= 256 * 256 * 4  # at least one intermediate matrix
  assert mem.total == mem.argument + mem.output + mem.temp - mem.alias
  assert mem.as_dict()["total"] == mem.total


def test_step_memory_sees_donation():
  x = jnp.ones((128, 128), jnp.float32)
  kept = memory.step_memory(lambda x: x * 2.0, x)
  donated = memory.step_memory(lambda x: x * 2.0, x, donate_argnums=0)
  assert kept.alias == 0 and donated.alias == 128 * 128 * 4
  assert donated.total < kept.total


def test_saved_residuals_excludes_arguments_and_constants():
  w = jnp.ones((8, 8))  # closed over: a constant
  f = lambda x, y: jnp.sum(jnp.sin(x * y) @ w)
  res = memory.saved_residuals(f, jnp.ones((4, 8)), jnp.ones((4, 8)))
  # sin(x*y) needs cos(x*y) (4x8 f32); x and y themselves are arguments.
  assert [(r.shape, r.dtype) for r in res.items] == [((4, 8), "float32")]
  assert res.total_bytes == 4 * 8 * 4
  assert res.items[0].origin == "<lambda>"
  assert res.by_origin() == {"<lambda>": 128}
  table = res.table()
  assert "float32[4, 8]" in table and "total" in table and "128" in table


def test_by_origin_groups_by_function():
  from lowmem_jax.norms import ms_layer_norm
  from lowmem_jax.activations import regelu2
  w = jnp.ones((16, 16), jnp.bfloat16)
  f = lambda x: jnp.sum(regelu2(ms_layer_norm(x) @ w) @ w)
  res = memory.saved_residuals(f, jnp.ones((4, 16), jnp.bfloat16))
  origins = res.by_origin()
  assert origins["ms_norm_forward"] == 4 * 16 * 2 + 4 * 4   # y (bf16) + rstd (fp32)
  assert origins["pack_2bit"] == 4 * 16 // 4                   # 2 bits per element
  assert res.total_bytes == sum(origins.values())


def test_format_table_aligns():
  text = memory.format_table(("a", "bb"), [("x", 1), ("yyy", 22)])
  lines = text.splitlines()
  assert len(lines) == 4 and len({len(line) for line in lines}) == 1


def test_theory_orders_policies():
  cfg = StackConfig()
  theory = {s: memory.theoretical_bytes_per_token(cfg, MemoryPolicy.parse(s), 2)
            for s in ("baseline", "approx-bp", "ms-bp", "lowmembp", "remat")}
  d, f = cfg.dim, cfg.mlp_dim
  assert theory["baseline"] - theory["approx-bp"] == 2 * f - f // 4   # GELU input -> 2 bits
  assert theory["baseline"] - theory["ms-bp"] == 2 * (2 * d + 8 - 4)  # LN input + stats
  assert theory["remat"] == 2 * d
  assert memory.theoretical_bytes_per_token(
      cfg, MemoryPolicy.parse("remat:dots_saveable"), 2) is None


def testsplit_policies_keeps_save_lists_together():
  assert memory.split_policies("baseline,remat:save=qkv_proj,attn_out,lowmembp") == [
      "baseline", "remat:save=qkv_proj,attn_out", "lowmembp"]


@pytest.mark.slow
def test_report_cli_prints_table_and_writes_json(tmp_path):
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, "-m", "lowmem_jax.memory", "--layers", "2", "--dim", "32",
       "--heads", "4", "--mlp-dim", "64", "--seq", "8", "--batch", "2",
       "--policies", "baseline,lowmembp,remat:save=qkv_proj,attn_out", "--json", str(out)],
      capture_output=True, text=True, timeout=300, check=True)
  assert "lowmembp" in proc.stdout and "compiled temp MiB" in proc.stdout
  data = json.loads(out.read_text())
  rows = {r["policy"]: r for r in data["rows"]}
  assert set(rows) == {"baseline", "lowmembp", "remat:save=qkv_proj,attn_out"}
  assert rows["lowmembp"]["residual_bytes_per_token_layer"] == \
      rows["lowmembp"]["theory_bytes_per_token_layer"]
  if jax.default_backend() == "cpu":  # the CPU compiler's figure; XLA:GPU fuses these
    assert rows["lowmembp"]["compiled"]["temp"] < rows["baseline"]["compiled"]["temp"]


def _no_work(*args, **kwargs):
  raise AssertionError("compiled before checking the arguments")


BAD_ARGS = [
    (["--dim", "65"], "--dim 65 is not divisible by --heads 2"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--heads", "0"], "--heads must be >= 1, got 0"),
    (["--kv-heads", "0"], "--kv-heads must be >= 1, got 0"),
    (["--heads", "4", "--kv-heads", "3"], "--heads 4 is not a multiple of --kv-heads 3"),
    (["--seq", "0"], "--seq must be >= 1, got 0"),
    (["--mlp-dim", "0"], "--mlp-dim must be >= 1, got 0"),
    (["--dim", "-8"], "--dim must be >= 1, got -8"),
    (["--policies", "nope"], "--policies: invalid policy 'nope': MemoryPolicy: unknown "
     "preset 'nope'"),
    (["--policies", ","], "--policies: names no policy, got ','"),
    (["--policies", "baseline,mesa8"], "--policies: the block stack cannot take 'mesa8': "
     "MemoryPolicy 'mesa8': its norm keeps state (CodedNorm), so it has no plain function "
     "(python -m models.step_memory measures it on a model)"),
    (["--json", "{tmp}"], "--json {tmp} is a directory; give a file name"),
    (["--json", "{tmp}/no/r.json"], "--json {tmp}/no/r.json: the directory {tmp}/no does not "
     "exist"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_report_cli_refuses_bad_arguments_before_any_compile(argv, message, tmp_path, capsys,
                                                             monkeypatch):
  monkeypatch.setattr(memory, "_report_rows", _no_work)
  tiny = ["--layers", "1", "--dim", "8", "--heads", "2", "--mlp-dim", "16", "--seq", "4",
          "--batch", "1", "--policies", "baseline"]
  argv = tiny + [a.format(tmp=tmp_path) for a in argv]
  assert cli_error(memory.main, argv, capsys).startswith(message.format(tmp=tmp_path))
  assert list(tmp_path.iterdir()) == []


def test_error_line_is_the_type_and_first_line_even_without_a_message():
  assert memory.error_line(ValueError("bad shape\nTraceback detail")) == "ValueError: bad shape"
  assert memory.error_line(RuntimeError()) == "RuntimeError:"
  assert memory.error_line(ValueError("x" * 900), 500) == "ValueError: " + "x" * 488
