"""Placement on a mesh: FSDP splits the largest divisible axis of each parameter, never a
stack's layer axis; data parallelism replicates parameters and splits the batch."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import TINY_TRAIN, with_test_xla_flags

ROOT = Path(__file__).resolve().parents[1]


def test_fsdp_splits_the_largest_axis_but_never_the_layer_axis():
  # 8 host devices need a fresh process (the flag is read when the backend starts).
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp
      from flax import nnx
      from models import vit
      from train import sharding
      # 64 layers of width 16: the layer axis is the largest of many variables
      model = vit.ViT(vit.config("vit-tiny", num_layers=64, dim=16, mlp_dim=32),
                      dtype=jnp.float32)
      state = sharding.shard_state({"params": nnx.state(model, nnx.Param)},
                                   sharding.make_mesh("data=2,fsdp=4"))
      for path, x in jax.tree_util.tree_leaves_with_path(state):
        name = jax.tree_util.keystr(path)
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        if "stack" in name:
          assert spec[0] is None, (name, spec)
        split = [a for a, s in enumerate(spec) if s == "fsdp"]
        if split:
          free = [a for a in range(1 if "stack" in name else 0, x.ndim) if x.shape[a] % 4 == 0]
          assert x.shape[split[0]] == max(x.shape[a] for a in free), (name, x.shape, spec)
      # data=8: every parameter replicated, the batch split 8 ways
      data = sharding.make_mesh("data=8")
      state = sharding.shard_state({"params": nnx.state(model, nnx.Param)}, data)
      assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state))
      batch = sharding.shard_batch({"image": jnp.zeros((16, 32, 32, 3))}, data)
      assert batch["image"].addressable_shards[0].data.shape == (2, 32, 32, 3)
      print("ok")
  """)
  _run_on_8_cpu_devices(code)


def test_fsdp_makes_the_optimizer_state_split_and_the_report_says_per_device(tmp_path):
  """Under fsdp AdamW's moments are split over all 8 devices; the memory report says it
  is per device (before: no word of it); a multi-host mesh over some of the devices is
  refused (a host outside it hung). (That the state is made split, never whole on one
  device, no CPU run can tell: every device here is the host's.)"""
  code = textwrap.dedent(f"""
      import jax, pytest
      from train import config as config_lib, sharding
      from train.batches import Batches
      from train.images import digits
      from train.memory_report import print_memory
      from train.trainer import Trainer
      cfg = config_lib.load_config("digits-vit", None, {TINY_TRAIN!r} + [
          "out_dir={tmp_path}", "mesh=data=2,fsdp=4", "compare_baseline=false"])
      trainer = Trainer.create(cfg)
      mu = [x for x in jax.tree.leaves(trainer.state["opt"]) if x.ndim]
      assert any("fsdp" in tuple(x.sharding.spec) for x in mu)
      assert all(len(x.sharding.device_set) == 8 for x in mu)
      report = print_memory(trainer, trainer.put(next(Batches(digits("train"), 32))), cfg)
      assert report["devices"] == 8
      jax.process_count = lambda: 2
      with pytest.raises(ValueError, match="uses 2 of the 8 devices of 2 hosts"):
        sharding.make_mesh("data=2")
      print("ok")
  """)
  out = _run_on_8_cpu_devices(code)
  assert "compiled step memory per device (8 devices) [lowmembp]" in out


def test_distributed_outside_a_cluster_is_a_one_line_error(tmp_path):
  """distributed=true where there is no cluster (a multi-host run's config.json resumed on
  one machine): one line saying to set distributed=false (before: "coordinator_address
  should be defined", naming nothing)."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TPU_", "CLOUD_TPU"))}
  proc = subprocess.run([sys.executable, "-m", "train", "--set", "distributed=true",
                         "--out-dir", str(tmp_path / "run")], cwd=tmp_path,
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: distributed=true: jax.distributed.initialize() failed (")
  assert last.endswith("outside a cluster set distributed=false to run on this machine alone")


def test_sharded_steps_compile_once(tmp_path):
  """The step's outputs come back with the shardings its inputs had (specs without
  trailing Nones, first_bad replicated): the second step reuses the first one's program."""
  code = textwrap.dedent(f"""
      import jax
      from train import config as config_lib
      from train.batches import Batches
      from train.images import digits
      from train.trainer import Trainer
      cfg = config_lib.load_config("digits-vit", None, {TINY_TRAIN!r} + [
          "out_dir={tmp_path}", "mesh=data=2,fsdp=4"])
      trainer = Trainer.create(cfg)
      batch = trainer.put(next(Batches(digits("train"), 32)))
      for _ in range(3):
        trainer.step(batch)
      assert int(trainer.state["step"]) == 3
      assert trainer.train_step._cache_size() == 1, trainer.train_step._cache_size()
      print("ok")
  """)
  _run_on_8_cpu_devices(code)


def test_a_batch_the_mesh_cannot_split_is_refused_before_the_run_folder(tmp_path):
  """batch_size must divide over the mesh's devices: said before anything is written (it
  failed at the first step, leaving a run folder that refused the corrected command)."""
  out = tmp_path / "run"
  code = textwrap.dedent(f"""
      import pathlib
      from train import config as config_lib, loop
      cfg = config_lib.load_config("digits-vit", None, {TINY_TRAIN!r} + [
          "out_dir={out}", "mesh=data=2", "batch_size=33"])
      try:
        loop.train(cfg)
      except ValueError as e:
        assert str(e) == "batch_size=33 is not divisible by the 2 devices of mesh='data=2'", e
      assert not pathlib.Path({str(out)!r}).exists()
      print("ok")
  """)
  _run_on_8_cpu_devices(code)


def test_micro_batches_stay_split_and_state_keeps_its_places(tmp_path):
  """grad_accum on a data mesh: each micro-batch is split over the devices (no all-gather
  of the batch; it gathered each micro-batch on every device) and the update is the full
  batch's. WTA-CRS's example ids, written from the batch into the state, keep the state's
  place (step 2 failed: compiled for other shardings). The abstract trainer of an FSDP run
  (the memory report's baseline, the planner) has the real state's shardings."""
  code = textwrap.dedent(f"""
      import jax, numpy as np
      from train import config as config_lib
      from train.batches import Batches
      from train.images import digits
      from train.planner import abstract_trainer
      from train.trainer import Trainer
      base = {TINY_TRAIN!r} + ["out_dir={tmp_path}", "mesh=data=4", "precision=highest"]
      batch = next(Batches(digits("train"), 32))
      states = {{}}
      for accum in (1, 4):
        trainer = Trainer.create(config_lib.load_config(
            "digits-vit", None, base + [f"grad_accum={{accum}}"]))
        b = trainer.put(batch)
        text = trainer.compile(b).as_text()
        assert "all-gather" not in text and "all-reduce" in text, accum
        for _ in range(2):
          trainer.step(b)
        states[accum] = jax.device_get(trainer.state["params"])
      for a, b in zip(jax.tree.leaves(states[1]), jax.tree.leaves(states[4])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)

      cfg = config_lib.load_config("digits-vit", None, base + [
          "policy=wta-crs", "grad_norm_cache=true"])
      trainer = Trainer.create(cfg)
      b = trainer.put(batch | {{"example_id": np.arange(32, dtype=np.int32)}})
      trainer.compile(b)  # the kept executable, as the memory report leaves it
      for _ in range(3):
        trainer.step(b)
      assert int(trainer.state["step"]) == 3 and trainer.train_step._cache_size() == 0

      cfg = config_lib.load_config("digits-vit", None, base[:-2] + ["mesh=data=2,fsdp=4"])
      real, abstract = Trainer.create(cfg), abstract_trainer(cfg)
      for x, y in zip(jax.tree.leaves((real.state, real.first_bad)),
                      jax.tree.leaves((abstract.state, abstract.first_bad))):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
      assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(abstract.state))
      print("ok")
  """)
  _run_on_8_cpu_devices(code)


def test_micro_batches_and_eval_batches_the_mesh_cannot_split_are_refused(tmp_path):
  """Before any work: a micro-batch (batch_size / grad_accum) or an eval batch that the
  devices cannot split (an eval batch ran whole on every device)."""
  code = textwrap.dedent(f"""
      from train import config as config_lib, loop
      base = {TINY_TRAIN!r} + ["out_dir={tmp_path / 'run'}", "mesh=data=4"]
      for extra, want in ((["grad_accum=16"], "batch_size=32 / grad_accum=16 = 2 examples "
                           "per micro-batch, not divisible by the 4 devices of mesh='data=4'"),
                          (["eval_batch_size=254"], "eval_batch_size=254 is not divisible by "
                           "the 4 devices of mesh='data=4' (try 252)")):
        try:
          loop.check_inputs(config_lib.load_config("digits-vit", None, base + extra))
          raise AssertionError(extra)
        except ValueError as e:
          assert str(e) == want, e
      print("ok")
  """)
  _run_on_8_cpu_devices(code)


def _run_on_8_cpu_devices(code: str) -> str:
  """Runs ``code`` in a Python subprocess with 8 host CPU devices; it prints "ok". Its
  stdout."""
  env = {**os.environ, "XLA_FLAGS": with_test_xla_flags("--xla_force_host_platform_device_count=8"),
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        env=env, timeout=300)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
  return proc.stdout


def test_8_bit_image_codes_split_over_the_mesh_and_train_as_their_floats(tmp_path):
  """uint8 image codes on a data mesh with grad_accum: the batch goes split as codes (a
  quarter of float32's bytes per device), each micro-batch is made floats where it lies
  (no all-gather), and the steps train and evaluate (a last batch the mesh cannot split
  included) as on the host's normalized floats."""
  code = textwrap.dedent(f"""
      import dataclasses
      import jax, numpy as np
      from train import config as config_lib
      from train.dataset import ArrayDataset
      from train.images import code_values, normalized
      from train.trainer import Trainer
      stats = (np.array([0.485, 0.456, 0.406], np.float32),
               np.array([0.229, 0.224, 0.225], np.float32))
      cfg = config_lib.load_config("digits-vit", None, {TINY_TRAIN!r} + [
          "out_dir={tmp_path}", "mesh=data=2", "precision=highest", "batch_size=8",
          "grad_accum=2", "model.channels=3", "optimizer=sgd", "lr=0.1", "warmup_steps=0"])
      rng = np.random.default_rng(0)
      codes = rng.integers(0, 256, (9, 8, 8, 3), dtype=np.uint8)
      labels = rng.integers(0, 10, 9).astype(np.int32)
      host = normalized(ArrayDataset({{"image": codes}}), *stats).take(np.arange(9))["image"]
      out = {{}}
      for name, images in (("codes", codes), ("floats", host)):
        trainer = dataclasses.replace(Trainer.create(cfg), pixel_values=code_values(stats))
        batch = trainer.put({{"image": images[:8], "label": labels[:8]}})
        shard = batch["image"].addressable_shards[0].data
        assert shard.shape == (4, 8, 8, 3) and shard.dtype == images.dtype, shard
        text = trainer.compile(batch).as_text()
        assert "all-gather" not in text and "all-reduce" in text, name
        for _ in range(2):
          trainer.step(batch)
        evaluated = trainer.evaluate([{{"image": images[i:i + 8], "label": labels[i:i + 8]}}
                                      for i in (0, 8)])
        out[name] = evaluated, jax.device_get(trainer.state["params"])
      for key, value in out["floats"][0].items():
        assert abs(out["codes"][0][key] - value) <= 1e-6 * abs(value), (key, out)
      for a, b in zip(jax.tree.leaves(out["codes"][1]), jax.tree.leaves(out["floats"][1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
      print("ok")
  """)
  _run_on_8_cpu_devices(code)
