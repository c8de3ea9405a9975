"""The memory-budget planner: budgets that force each choice (real compiled peaks of a tiny
ViT, three compiles), the bounded search against brute force and the error (made-up peaks),
the printed table, speeds, budget parsing, and the training loop's hook."""

import dataclasses
import functools
import json
import re
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import TINY_TRAIN
from train import config as config_lib
from train import planner
from train.batches import Batches
from train.images import digits

# The tiny ViT of conftest.TINY_TRAIN at batch 32 with SGD and one step: the very train step
# test_train's gradient-accumulation test compiles, so the loop test below shares it (one
# compilation cache per session). The real-peak tests ask for three peaks (baseline at
# grad_accum 1 and 2, lowmembp at 1): three planner compiles in all, memoized.
POLICIES = ("baseline", "lowmembp")
BASE = ["steps=1", "optimizer=sgd", "grad_clip=0.0"]
# Speeds that make a leaner policy at the full batch beat more micro-batches.
TABLE = {"cpu": {"step_time": {"baseline": 1.0, "lowmembp": 1.3},
                 "micro_batch_penalty": 0.5}}


def _cfg(*extra):
  return config_lib.load_config("digits-vit", None, TINY_TRAIN + BASE + list(extra))


@pytest.fixture(scope="module")
def example():
  return Batches(digits("train"), 32).peek()


@pytest.fixture(scope="module")
def predict():
  """planner.predict_peak memoized per (policy, grad_accum)."""
  @functools.cache
  def peak(policy, accum, shapes_key):
    return planner.predict_peak(_cfg(f"policy={policy}", f"grad_accum={accum}"),
                                dict(shapes_key))
  return lambda cfg, shapes: peak(cfg.policy, cfg.grad_accum, tuple(sorted(shapes.items())))


@pytest.fixture(scope="module")
def truth(example, predict):
  """Real predicted peaks: {(policy, grad_accum): bytes}."""
  shapes = {k: jax.ShapeDtypeStruct(v.shape, jax.dtypes.canonicalize_dtype(v.dtype))
            for k, v in example.items()}
  return {(policy, accum): predict(_cfg(f"policy={policy}", f"grad_accum={accum}"), shapes)
          for policy, accum in (("baseline", 1), ("baseline", 2), ("lowmembp", 1))}


def test_peaks_shrink_with_the_micro_batch_and_the_leaner_policy(truth):
  """The premises the budgets below rest on."""
  assert truth["baseline", 2] < truth["lowmembp", 1] < truth["baseline", 1], truth


def test_budgets_force_each_choice(example, predict, truth):
  cfg = _cfg()
  cases = {  # budget -> the expected (policy, grad_accum), how many peaks compiled
      2 ** 40: ("baseline", 1, 1),                         # fastest, full batch
      truth["baseline", 1] - 1: ("lowmembp", 1, 2),        # a leaner policy
      truth["lowmembp", 1] - 1: ("baseline", 2, 3),        # more micro-batches
  }
  for budget, (policy, accum, compiled) in cases.items():
    plan = planner.plan(cfg, example, budget, policies=POLICIES, table=TABLE,
                        predict=predict)
    assert (plan.chosen.policy, plan.chosen.grad_accum) == (policy, accum), budget
    assert plan.chosen.peak == truth[policy, accum] <= budget
    assert plan.compiled == compiled
    new = plan.apply(cfg)  # the global batch kept
    assert (new.policy, new.grad_accum, new.batch_size) == (policy, accum, 32)
    assert plan.chosen.micro_batch * plan.chosen.grad_accum == cfg.batch_size


def test_no_plan_fits_names_the_smallest_peak(example):
  """Made-up peaks (lowmembp leaner, shrinking with the micro-batch): one line naming the
  budget and the smallest peak found, lowmembp's at micro-batch 1."""
  def predict(cfg, shapes):
    return 10 ** 6 + cfg.batch_size // cfg.grad_accum * (2 if cfg.policy == "baseline" else 1)
  lines = []  # progress: a line per candidate compiled, before the error
  with pytest.raises(ValueError) as e:
    planner.plan(_cfg(), example, 10 ** 6, policies=POLICIES, table=TABLE, predict=predict,
                 progress=lines.append)
  assert str(e.value) == (
      "memory_budget 1.0 MiB (1000000 bytes): no plan fits; the smallest predicted peak is "
      "1.0 MiB (1000001 bytes: lowmembp, micro-batch 1 x grad_accum 32)")
  assert lines[0] == ("planner: memory_budget 1.0 MiB; 12 candidate plans, compiled (nothing "
                      "run) fastest first until one fits")
  # 3 compiles per policy: micro-batches 32, 16 (its second miss), then 1 (its least peak)
  assert sorted(x.split(":")[1] for x in lines[1:-1]) == sorted(
      f" {p}, micro-batch {m} x grad_accum {32 // m}" for p in POLICIES for m in (32, 16, 1))
  assert all(", over budget (" in x for x in lines[1:-1])
  assert re.fullmatch(r"planner: lowmembp, micro-batch 1 x grad_accum 32: predicted peak "
                      r"1\.0 MiB, over budget \(\d+\.\d s\)", lines[-2]), lines[-2]
  # then the table of what was compiled: each compiled row over budget, none chosen
  table = lines[-1].splitlines()
  assert table[0].split()[:2] == ["policy", "micro-batch"] and "<- chosen" not in lines[-1]
  compiled = [r for r in table[2:] if "MiB" in r]
  assert len(compiled) == len(lines) - 2 and all(r.endswith("over budget") for r in compiled)


def test_a_budget_below_the_train_state_fails_before_any_compile(example, monkeypatch):
  """The train state (parameters, optimizer state) is held by every plan: a budget below
  the least of the policies' states is one line naming the budget and that state, from the
  abstract trainer's shapes, with nothing lowered or compiled. Its bytes: the real state's
  (a tiny model, built for real here), per policy."""
  from train.trainer import Trainer
  real = {}
  for policy in POLICIES:
    trainer = Trainer.create(_cfg(f"policy={policy}"))
    real[policy] = sum(x.nbytes for x in jax.tree.leaves((trainer.state, trainer.first_bad)))
    assert planner.state_bytes(_cfg(f"policy={policy}")) == real[policy]
  least = min(POLICIES, key=real.get)
  assert real[least] < max(real.values())  # baseline's norms keep a bias lowmembp drops

  def refuse(*args, **kwargs):
    raise AssertionError("the planner compiled a candidate")
  monkeypatch.setattr(Trainer, "lower", refuse)
  monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
  for budget in (1024, real[least] - 1):
    with pytest.raises(ValueError) as e:
      planner.plan(_cfg(), example, budget, policies=POLICIES, table=TABLE, predict=refuse)
    assert str(e.value) == (
        f"memory_budget {planner.fmt_bytes(budget)} ({budget} bytes): no plan can fit; the "
        f"train state alone (parameters and optimizer state, held under every plan) is "
        f"{planner.fmt_bytes(real[least])} ({real[least]} bytes under {least}, the least of "
        f"the policies)")
  assert " KiB (" in str(e.value) and "0.0" not in str(e.value)  # ~74 KiB, readable
  # at the state's bytes the search runs (made-up peaks, none fits: the usual error)
  with pytest.raises(ValueError, match=rf"^memory_budget .* \({real[least]} bytes\): no plan "
                                       r"fits; the smallest predicted peak is"):
    planner.plan(_cfg(), example, real[least], policies=POLICIES, table=TABLE,
                 predict=lambda cfg, shapes: real[least] + 1)


def test_the_train_state_is_below_every_predicted_peak(truth):
  """The early error's premise, on real compiled peaks: a policy's state <= its peaks."""
  for (policy, accum), peak in truth.items():
    assert planner.state_bytes(_cfg(f"policy={policy}", f"grad_accum={accum}")) < peak


@pytest.mark.parametrize("n,text", [
    (0, "0 bytes"), (1023, "1023 bytes"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (102_399, "100.0 KiB"), (104_858, "0.1 MiB"), (10 ** 6, "1.0 MiB"),  # the error above
    (16_028_640, "15.3 MiB"), (2 ** 30 - 1, "1024.0 MiB"), (2 ** 30, "1.00 GiB"),
    (20 * 2 ** 30, "20.00 GiB")])
def test_fmt_bytes_is_readable_at_every_scale(n, text):
  """Never "0.0 MiB" for a non-zero size; MiB and GiB as the docs' tables print them."""
  assert planner.fmt_bytes(n) == text


def test_search_bisects_many_micro_batches():
  """Batch 48 (10 micro-batch sizes), four policies, made-up peaks that shrink with the
  micro-batch: brute force's choice at every budget, at most 3 + ceil(log2(10 - 2)) = 6
  peaks asked per policy, 3 of a policy none of whose plans fits."""
  policies = ("baseline", "lowmembp", "lowmem", "lowmembp+remat")
  table = {"cpu": {"step_time": {"baseline": 1.0, "lowmembp": 1.05, "lowmem": 1.2,
                                 "lowmembp+remat": 1.33}, "micro_batch_penalty": 0.03}}
  cands = planner.candidates(_cfg("batch_size=48"), policies, table, "cpu")
  assert len(cands) == 40 and all(c.micro_batch * c.grad_accum == 48 for c in cands)
  lean = {"baseline": 1.0, "lowmembp": 0.8, "lowmem": 0.5, "lowmembp+remat": 0.3}
  peak = lambda c: int(1000 + 100 * lean[c.policy] * c.micro_batch)
  for budget in sorted({peak(c) + d for c in cands for d in (-1, 0)}) + [10 ** 9]:
    asked = []
    _, chosen = planner.search(cands, lambda c: asked.append(c) or peak(c), budget)
    fitting = [c for c in cands if peak(c) <= budget]
    assert chosen == (dataclasses.replace(fitting[0], peak=peak(fitting[0]))
                      if fitting else None), budget
    for policy in policies:
      fit = any(c.policy == policy and peak(c) <= budget for c in cands)
      assert sum(c.policy == policy for c in asked) <= (6 if fit else 3), (budget, policy)


def test_table_is_printed_fastest_first(example, predict, truth):
  plan = planner.plan(_cfg(), example, truth["baseline", 1] - 1, policies=POLICIES,
                      table=TABLE, predict=predict)
  lines = plan.table().splitlines()
  assert lines[0].split() == ["policy", "micro-batch", "grad_accum", "predicted", "peak",
                              "expected", "speed", "chosen"]
  rows = [line.split() for line in lines[2:]]
  assert [(r[0], r[2]) for r in rows[:5]] == [("baseline", "1"), ("lowmembp", "1"),
                                              ("baseline", "2"), ("lowmembp", "2"),
                                              ("baseline", "4")]
  assert len(rows) == 12  # micro-batches 32, 16, 8, 4, 2, 1 of each policy
  assert rows[1][-2:] == ["<-", "chosen"] and "1.000 (table)" in lines[2]
  assert "0.769 (table)" in lines[3]  # 1 / 1.3
  assert "not compiled: no faster than the chosen" in lines[4]
  assert plan.compiled == 2  # baseline's full batch did not fit, lowmembp's did
  assert "chosen lowmembp, micro-batch 32 x grad_accum 1" in plan.summary()


def test_speeds_from_the_table_or_the_cost_model():
  table = planner.load_speed_table()
  assert {"cpu", "h100", "h200"} <= set(table)
  cands = planner.candidates(_cfg("batch_size=4"), ("baseline", "lowmembp+remat", "offload"),
                             table, None)
  model = {(c.policy, c.grad_accum): c for c in cands}  # unknown device: the cost model
  assert all(c.speed_from == "model" for c in cands)
  assert model["lowmembp+remat", 1].step_time == pytest.approx(4 / 3)
  assert model["offload", 1].step_time == pytest.approx(7 / 6)
  assert model["baseline", 4].step_time == pytest.approx(1 + 3 * planner.MICRO_BATCH_PENALTY)
  h100 = {(c.policy, c.grad_accum): c
          for c in planner.candidates(_cfg(), ("lowmem",), table, "h100")}
  assert h100["lowmem", 1].speed_from == "table"
  assert h100["lowmem", 1].step_time == table["h100"]["step_time"]["lowmem"]
  assert h100["lowmem", 2].speed_from == "model"  # no measured micro-batch penalty
  # a recompute on top of a measured policy: the table's time plus the model's cost of it
  cpu = {c.policy: c for c in planner.candidates(
      _cfg("batch_size=1"), ("lowmembp+qkv=recompute+hidden=recompute",), table, "cpu")}
  got = cpu["lowmembp+hidden=recompute+qkv=recompute"]  # canonical, as the memory report
  assert got.speed_from == "table+model"
  assert got.step_time == pytest.approx(table["cpu"]["step_time"]["lowmembp"] + 1 / 12
                                        + planner.RECOMPUTE_HIDDEN)
  gpu = lambda kind: types.SimpleNamespace(platform="gpu", device_kind=kind)
  assert planner.device_family(table, gpu("NVIDIA H100 80GB HBM3")) == "h100"
  assert planner.device_family(table, gpu("NVIDIA H200")) == "h200"
  assert planner.device_family(table, gpu("NVIDIA A100-SXM4-80GB")) is None  # the model
  assert planner.device_family(table, jax.devices("cpu")[0]) == "cpu"


@pytest.mark.parametrize("text,size", [("20GiB", 20 * 2 ** 30), ("512MiB", 512 * 2 ** 20),
                                       ("1.5 GB", 1_500_000_000), (4096, 4096),
                                       ("1310720", 1310720),  # bytes as text (llama_fit's)
                                       ("auto", "auto")])
def test_budget_parsing(text, size):
  assert config_lib.parse_budget(text) == size
  assert _cfg(f"memory_budget={text}").memory_budget is not None


@pytest.mark.parametrize("text", ["20gib", "20 GiBs", "GiB", "1e9", "0", "-5MiB",
                                  "true"])
def test_bad_budgets_name_the_field(text):
  with pytest.raises(ValueError, match=r"^TrainConfig: memory_budget=.*'20GiB'"):
    _cfg(f"memory_budget={text}")
  with pytest.raises(ValueError, match=r"^TrainConfig: memory_budget='1.5'"):
    config_lib.parse_budget("1.5")  # a fraction of a byte


def test_auto_on_cpu_is_a_clear_error():
  with pytest.raises(ValueError, match=r"memory_budget='auto' needs .* cpu does not: give a "
                                       r"size, e.g. memory_budget=8GiB"):
    planner.resolve_budget("auto", jax.devices("cpu")[0])


def test_auto_is_the_device_limit_less_the_margin():
  gpu = types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 80 << 30})
  assert planner.resolve_budget("auto", gpu) == int((80 << 30) * (1 - planner.AUTO_MARGIN))
  assert planner.resolve_budget("2GiB", gpu) == 2 << 30


def test_budget_with_a_mesh_or_grad_norm_cache_is_refused():
  with pytest.raises(ValueError, match="memory_budget plans for one device"):
    _cfg("memory_budget=1GiB", "mesh=data=1")
  with pytest.raises(ValueError, match="grad_norm_cache=true .* does not work with it"):
    _cfg("memory_budget=1GiB", "grad_norm_cache=true")


def test_train_runs_the_plan(tmp_path, capsys, monkeypatch):
  """train(): the table before step 1, the chosen policy and grad_accum used and recorded,
  and on CPU the line saying the real peak is not available. The speeds make lowmembp
  fastest, so the step trained is test_train's (compiled once per session)."""
  from train.loop import train
  # these speeds for whatever device runs the test (CPU or GPU)
  monkeypatch.setattr(planner, "load_speed_table", lambda: {"this": TABLE_LOWMEMBP_FIRST})
  monkeypatch.setattr(planner, "device_family", lambda table, device=None: "this")
  train(_cfg(f"out_dir={tmp_path}", "memory_budget=1TiB", "policy=lowmem", "save_every=0"))
  out = capsys.readouterr().out
  on_cpu = jax.default_backend() == "cpu"  # a GPU reports the real peak after step 1
  table = out.index("expected speed")  # the table's header
  step1 = out.index("real peak is not available" if on_cpu else "of the real peak")
  assert table < out.index("compiled step memory [lowmembp]") < step1
  assert out.index("planner: memory_budget 1024.00 GiB; ") < out.index(
      "planner: lowmembp, micro-batch 32 x grad_accum 1: predicted peak ") < table
  assert "chosen lowmembp, micro-batch 32 x grad_accum 1" in out
  saved = json.loads((Path(tmp_path) / "config.json").read_text())
  assert (saved["policy"], saved["grad_accum"], saved["batch_size"]) == ("lowmembp", 1, 32)
  # the compilation cache in use: this session's JAX_COMPILATION_CACHE_DIR, not the default
  assert saved["compile_cache"] == jax.config.jax_compilation_cache_dir
  events = [json.loads(x) for x in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
  plan_event, = [e for e in events if e.get("event") == "plan"]
  assert plan_event["policy"] == "lowmembp" and plan_event["predicted_peak"] > 0
  check, = [e for e in events if e.get("event") == "plan_check"]
  assert check["predicted_peak"] == plan_event["predicted_peak"]
  assert check["real_peak"] is None if on_cpu else check["real_peak"] > 0
  # resumed, the run keeps its plan, whatever the planner would choose now (baseline first)
  monkeypatch.setattr(planner, "load_speed_table", lambda: {"this": TABLE})
  result = train(_cfg(f"out_dir={tmp_path}", "memory_budget=1TiB", "policy=lowmem",
                      "save_every=0", "steps=2", "resume=true"))
  out = capsys.readouterr().out
  assert (f"planner: resuming the plan the run chose (policy lowmembp, grad_accum 1, "
          f"eval_batch_size {saved['eval_batch_size']}, checkpoint step 1); memory_budget is "
          "not planned again") in out
  assert "expected speed" not in out and "resumed from step 1" in out and result["step"] == 2
  saved = json.loads((Path(tmp_path) / "config.json").read_text())
  assert (saved["policy"], saved["grad_accum"]) == ("lowmembp", 1)
  # the eval batch the plan chose is kept too, whatever the command's config says (a
  # named config's default replaced a halved one: an eval over the budget)
  from train.loop import _checkpoint_plan
  other = f"eval_batch_size={3 * saved['eval_batch_size']}"
  kept = _checkpoint_plan(_cfg("memory_budget=1TiB", other), Path(tmp_path))
  assert (kept.policy, kept.grad_accum, kept.eval_batch_size) == (
      "lowmembp", 1, saved["eval_batch_size"])
  # the command's own policy on a planned run is refused (before, silently replaced by
  # the plan's); with the budget turned off it is a resume under another policy
  from train.runs import resumed_config
  where = _cfg(f"out_dir={tmp_path}")
  with pytest.raises(ValueError, match=r"^policy: the run in .* chose its policy, "
                     r"grad_accum and eval batch by memory_budget=1TiB, which a resume "
                     r"keeps; to resume under another, add --set memory_budget=null$"):
    resumed_config(where, ["policy=baseline", "steps=3"])
  assert resumed_config(where, ["policy=baseline", "memory_budget=null"]).policy == "baseline"
  # the same when the command also names a config (before: silently resumed the plan)
  from train.__main__ import main
  with pytest.raises(ValueError, match=r"^grad_accum, policy: the run in .* chose its "
                     r"policy, grad_accum and eval batch by memory_budget=1TiB, which a "
                     r"resume keeps"):
    main(["--config-name", "digits-vit", "--resume", "--out-dir", str(tmp_path), "--set",
          "memory_budget=1TiB", "--policy", "baseline", "--set", "grad_accum=2"])
  # a run that was not planned is not said to be (the loop refuses the budget itself)
  from train.runs import refuse_named_plan
  unplanned = Path(tmp_path) / "unplanned"
  unplanned.mkdir()
  (unplanned / "config.json").write_text(json.dumps({"memory_budget": None}))
  refuse_named_plan(unplanned, {"policy"}, "2MiB")


def test_the_grad_accum_a_plan_replaces_need_not_divide_the_batch(tmp_path, monkeypatch):
  """Under memory_budget the plan picks grad_accum (a divisor of batch_size): the user's
  own is not checked against the batch (before: "batch_size 32 is not a multiple of
  grad_accum 3" for a value the plan replaces); without a budget it still is."""
  from train import loop

  class Planned(Exception):
    pass

  def plan(cfg, train_set, eval_set, budget):
    raise Planned(cfg.grad_accum)
  monkeypatch.setattr(loop, "_plan", plan)
  with pytest.raises(Planned):
    loop.train(_cfg(f"out_dir={tmp_path / 'a'}", "memory_budget=1GiB", "grad_accum=3"))
  with pytest.raises(ValueError, match="batch_size 32 is not a multiple of grad_accum 3"):
    loop.train(_cfg(f"out_dir={tmp_path / 'b'}", "grad_accum=3"))


def test_a_budget_added_at_a_resume_is_refused_before_any_work(tmp_path):
  """A run that was not planned keeps its policy and grad_accum when resumed: a budget
  given then is one error (before, it planned afresh, then failed on the checkpoint's
  arrays); a planned run resumes its plan."""
  from train.checkpoint import Checkpoints
  from train.loop import _checkpoint_plan
  ckpt = Checkpoints(tmp_path / "checkpoints")
  ckpt.save(3, {"x": np.zeros(2, np.float32)},
            {"config": {"policy": "lowmembp", "grad_accum": 1, "memory_budget": None}})
  ckpt.close()
  cfg = _cfg("memory_budget=20MiB", "resume=true")
  with pytest.raises(ValueError, match=r"^memory_budget=20MiB: the run in .* was not "
                     r"planned \(policy lowmembp, grad_accum 1\), and a resume keeps"):
    _checkpoint_plan(cfg, tmp_path)
  ckpt = Checkpoints(tmp_path / "checkpoints")
  ckpt.save(4, {"x": np.zeros(2, np.float32)},
            {"config": {"policy": "baseline", "grad_accum": 2, "memory_budget": "1GiB"}})
  ckpt.close()
  kept = _checkpoint_plan(cfg, tmp_path)
  assert (kept.policy, kept.grad_accum) == ("baseline", 2)
  # a batch_size the kept grad_accum does not divide: one line (was a reshape traceback
  # after the resume, with the batch_size already written to config.json)
  with pytest.raises(ValueError, match=r"^batch_size 33 is not a multiple of grad_accum 2, "
                     r"which the run's plan chose and a resume keeps"):
    _checkpoint_plan(cfg.replace(batch_size=33), tmp_path)


def test_a_new_run_naming_policy_or_grad_accum_beside_a_budget_is_refused(tmp_path):
  """The plan chooses them: named on the command line they were silently replaced."""
  from train.__main__ import main
  with pytest.raises(ValueError, match=r"^grad_accum, policy: memory_budget=1GiB chooses "
                     r"the policy and grad_accum; name them without memory_budget, or the "
                     r"budget alone$"):
    main(["--out-dir", str(tmp_path / "run"), "--set", "memory_budget=1GiB", "--policy",
          "lowmembp+remat", "--set", "grad_accum=7"])
  assert not (tmp_path / "run").exists()


def test_the_eval_batch_is_halved_until_its_peak_fits(example):
  """Eval runs beside the whole train state at eval_batch_size: a vocabulary's logits per
  token made it 1.5-2.5x the budget the train step fitted. The plan halves the eval batch
  until its predicted peak fits (metrics do not depend on it), or says one example does
  not fit."""
  cfg = _cfg("eval_batch_size=100")
  seen = []

  def predict_eval(cfg, shapes):  # made up: 10^5 bytes of state, 2 x 10^4 per example
    size, = {s.shape[0] for s in shapes.values()}
    seen.append(size)
    return 10 ** 5 + 2 * 10 ** 4 * size
  predict = lambda cfg, shapes: 10 ** 5
  plan = planner.plan(cfg, example, 10 ** 6, policies=POLICIES, table=TABLE, predict=predict,
                      predict_eval=predict_eval)
  assert seen == [100, 50, 25] and (plan.eval_batch_size, plan.eval_peak) == (25, 600000)
  assert plan.apply(cfg).eval_batch_size == 25
  assert plan.summary().endswith("; eval_batch_size 25, predicted eval peak 0.6 MiB")
  with pytest.raises(ValueError, match=r"^memory_budget 0.1 MiB \(110000 bytes\): the "
                     r"plan chosen \(baseline, grad_accum 1\) trains within it, but its eval "
                     r"step needs 0.1 MiB \(120000 bytes\) at eval_batch_size 1$"):
    planner.plan(cfg, example, 110000, policies=POLICIES, table=TABLE, predict=predict,
                 predict_eval=predict_eval)


@pytest.mark.slow
def test_the_eval_peak_is_the_state_and_the_eval_step(example):
  """predict_eval_peak: the train state plus the compiled eval step less its weights
  (the state's), growing with the eval batch."""
  cfg = _cfg()
  shapes = lambda n: {k: jax.ShapeDtypeStruct((n,) + v.shape[1:],
                                              jax.dtypes.canonicalize_dtype(v.dtype))
                      for k, v in example.items()}
  small, large = (planner.predict_eval_peak(cfg, shapes(n)) for n in (8, 64))
  assert planner.state_bytes(cfg) < small < large


TABLE_LOWMEMBP_FIRST = {"step_time": {"lowmembp": 1.0, "baseline": 1.5},
                        "micro_batch_penalty": 0.5}


def test_candidates_are_named_by_canonical_spec_once_each():
  """The planner's table names a policy as the memory report and the saved config do (its
  canonical spec); two spellings of one policy are one candidate, not two compiles."""
  from lowmem_jax.policy import MemoryPolicy
  specs = ("mesa8+lowmembp", "lowmem", "qkv=recompute+lowmembp+hidden=recompute",
           "lowmembp+hidden=recompute+qkv=recompute")
  names = [c.policy for c in planner.candidates(_cfg("batch_size=1"), specs, {}, None)]
  assert names == ["lowmembp+hidden=recompute+qkv=recompute", "lowmem"]  # fastest first
  assert all(MemoryPolicy.parse(p).spec == p for p in planner.DEFAULT_POLICIES)


def test_cost_model_counts_what_each_policy_recomputes():
  from lowmem_jax.policy import MemoryPolicy
  t = lambda spec: planner.modelled_step_time(MemoryPolicy.parse(spec))
  assert t("baseline") == t("lowmembp") == 1.0
  assert t("lowmem") == pytest.approx(1.0 + planner.QUANT_COST)
  # a quarter of the forward's matmuls again; nothing more under remat, which recomputes all
  assert t("lowmem+qkv=recompute") == pytest.approx(t("lowmem") + 1 / 12)
  assert t("remat+qkv=recompute") == t("remat") == pytest.approx(4 / 3)
  # the activation's output again: one elementwise pass
  assert t("lowmembp+qkv=recompute+hidden=recompute") == pytest.approx(1 + 1 / 12 + 0.01)
  assert t("remat+hidden=recompute") == t("remat")


def test_a_step_that_lowers_to_a_compiled_program_is_not_compiled_again(example,
                                                                       monkeypatch):
  """lowmem+hidden=recompute is lowmem on a GELU model (the 2-bit code stays): the
  planner takes the peak compiled for lowmem, and compiles a different step."""
  shapes = {k: jax.ShapeDtypeStruct(v.shape, jax.dtypes.canonicalize_dtype(v.dtype))
            for k, v in example.items()}
  monkeypatch.setattr(planner, "_PEAKS", {})
  compiles = []
  real = jax.stages.Lowered.compile

  def counted(self, *args, **kwargs):
    compiles.append(1)
    return real(self, *args, **kwargs)
  monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
  peaks = [planner.predict_peak(_cfg(f"policy={p}"), shapes)
           for p in ("lowmem", "lowmem+hidden=recompute", "lowmembp")]
  assert peaks[0] == peaks[1] != peaks[2] and len(compiles) == 2, (peaks, compiles)


def test_a_reversible_model_plans_over_its_own_policies(example):
  """revvit/revllama get the reversible policies (they refuse lowmem's and remat's blocks:
  the planner compiled those for minutes, then failed on lowmem); a policy the model refuses
  is dropped before any compile, and none left is one line."""
  assert planner.policies_for(_cfg()) == planner.DEFAULT_POLICIES
  rev = _cfg("model=revvit-digits")
  assert planner.policies_for(rev) == planner.REVERSIBLE_POLICIES
  assert planner.policies_for(rev, ("lowmem", "pareprop", "lowmembp+remat")) == ("pareprop",)
  assert planner.policies_for(_cfg(), ("baseline", "reversible")) == ("baseline",)
  with pytest.raises(ValueError, match=r"^planner: none of the policies lowmem, remat runs "
                                       r"on RevViT$"):
    planner.policies_for(rev, ("lowmem", "remat"))
  seen = []

  def predict(cfg, shapes):  # made up: only the reversible policies fit
    seen.append(cfg.policy)
    return 10 ** 6 if "reversible" in cfg.policy or "pareprop" in cfg.policy else 10 ** 9
  plan = planner.plan(rev, example, 2 * 10 ** 6, table={}, predict=predict)
  assert plan.chosen.policy == "reversible" and plan.chosen.grad_accum == 1
  assert set(seen) <= set(planner.REVERSIBLE_POLICIES)


def test_a_measured_micro_batch_penalty_holds_only_where_measured():
  """The cpu table's penalty was fitted on grad_accum 2-8: past it, the cost model's, and
  the row says so (it read "1.000 (table)" at grad_accum 32, measured 0.71-0.75)."""
  table = {"t": {"step_time": {"baseline": 1.0}, "micro_batch_penalty": 0.0,
                 "micro_batch_penalty_up_to": 8}}
  rows = {c.grad_accum: c for c in planner.candidates(_cfg(), ["baseline"], table, "t")}
  assert (rows[8].step_time, rows[8].speed_from) == (1.0, "table")
  assert rows[32].speed_from == "model"
  assert rows[32].step_time == pytest.approx(1 + planner.MICRO_BATCH_PENALTY * 31)
  assert planner.load_speed_table()["cpu"]["micro_batch_penalty_up_to"] == 8
