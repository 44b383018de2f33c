"""Training over devices and processes: the smoke preset on 1 or 4 devices of one process
and on 2 processes of 2 devices each (`jax.distributed` on localhost, gloo between the
processes' CPU devices) plays the same episodes and reaches the same parameters; one
process's checkpoint resumes in two; self-play needs no communication but one all-gather
of its episodes, each update one all-reduce of its gradients; work the devices do not divide is
refused.

Tolerance. The episodes' decisions, the key and every integer in the state match bit for
bit. The parameters and the optimizer state match to `RTOL`/`ATOL`: the gradient is a sum
over the minibatch, which one device adds in one order and n devices add as n partial
sums (all-reduced in the collective's order), so they differ by float reassociation;
so do the second iteration's search policies, searched with those parameters. Measured
after two iterations of SMOKE on 1 and 4 devices (2-core CPU): parameters at most 1.2e-7
apart (largest 1.5), optimizer state 1.4e-8, search policies 2.7e-7 (on 2.0% of their
entries), value targets and features equal: `ATOL` is 1e-6, 3.7x the largest. The metrics
are means of these, within `RTOL` (the policy KL 1.8e-7 apart on 0.29); the policy KL is
summed term by term (`agents.train.loss`): as the cross-entropy less the entropy, it
carries the reassociation error of a cross-entropy of 3.9 (2.7e-6 on a KL of 0.19).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents import checkpoint, train
from automap_rl.xla.hlo.collectives import COLLECTIVE_KINDS, module_collectives
from automap_rl.xla.hlo.module import parse_module
from experiments import cli, train_cmd
from experiments.distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

# The smoke preset without pipeline options (a third of its compile time): what is
# distributed does not depend on them.
_PRESET = train_cmd.PRESETS["smoke"]
SMOKE = dataclasses.replace(
  _PRESET,
  iterations=2,
  wandb="disabled",
  progress=False,
  learning_curve=False,
  train=dataclasses.replace(
    _PRESET.train, network=dataclasses.replace(_PRESET.train.network, pipelines=0)
  ),
)
RTOL, ATOL = 1e-5, 1e-6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A worker process: runs `automap-rl train` once per argument (a JSON list of flags).
WORKER = (
  "import json, sys\nfrom experiments import cli\n"
  "for a in sys.argv[1:]:\n  assert cli.main(json.loads(a)) == 0\n"
)


def flags(config: train_cmd.TrainRunConfig) -> list[str]:
  """The `automap-rl train` flags of a smoke-based config."""
  return [
    "train",
    "--preset",
    "smoke",
    "--iterations",
    str(config.iterations),
    "--run-dir",
    config.run_dir,
    "--wandb",
    config.wandb,
    "--no-progress",
    "--no-learning-curve",
    "--train.network.pipelines",
    str(config.train.network.pipelines),
  ]


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory) -> train_cmd.TrainResult:
  """Two iterations of the smoke preset on 4 devices of this process."""
  return train_cmd.run(
    dataclasses.replace(SMOKE, devices=4, run_dir=str(tmp_path_factory.mktemp("four")))
  )


def assert_same_training(a: train.TrainState, b: train.TrainState) -> None:
  """The same training: the integer and boolean leaves (the episodes' problems, decisions
  and masks in the buffer, the key, counts) bit for bit, the float leaves (parameters,
  optimizer state, the policy and value targets searched with them) within float
  reassociation."""
  for x, y in zip(
    jax.tree.leaves(train.host_copy(a)), jax.tree.leaves(train.host_copy(b)), strict=True
  ):
    if np.issubdtype(x.dtype, np.floating):
      np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL)
    else:
      np.testing.assert_array_equal(x, y)


def assert_same_metrics(rows: list[dict], want: list[dict]) -> None:
  assert [r["iteration"] for r in rows] == [r["iteration"] for r in want]
  for r, w in zip(rows, want):
    assert r.keys() == w.keys()
    for k in r.keys() - {"seconds"}:
      assert r[k] == pytest.approx(w[k], rel=RTOL, abs=ATOL), k


@pytest.mark.slow  # The two-process test below reads the same four devices against one process.
def test_one_and_four_devices_train_alike(four_devices, tmp_path):
  one = train_cmd.run(dataclasses.replace(SMOKE, devices=1, run_dir=str(tmp_path)))
  assert_same_training(one.state, four_devices.state)
  assert_same_metrics(one.metrics, four_devices.metrics)
  start = train.init(SMOKE.train, train_cmd.build_suite(SMOKE)[1])
  moved = [
    float(np.abs(np.asarray(x) - y).max())
    for x, y in zip(
      jax.tree.leaves(start.params), jax.tree.leaves(train.host_copy(one.state.params))
    )
  ]
  assert max(moved) > 100 * ATOL  # The updates moved the parameters by more than the tolerance.


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_train_as_one_process_of_four_devices(four_devices, tmp_path):
  fresh = dataclasses.replace(SMOKE, run_dir=str(tmp_path / "fresh"))
  # One process's checkpoint after the first iteration (the four-device run's, without its
  # second), resumed by the two processes.
  resumed = dataclasses.replace(SMOKE, run_dir=str(tmp_path / "resumed"))
  shutil.copytree(four_devices.run_dir, resumed.run_dir)
  shutil.rmtree(os.path.join(resumed.run_dir, checkpoint.CHECKPOINTS_DIR, "2"))
  port = free_port()
  procs = []
  for index in range(2):
    env = {
      **os.environ,
      "XLA_FLAGS": os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=2"),
      COORDINATOR_ENV: f"localhost:{port}",
      NUM_PROCESSES_ENV: "2",
      PROCESS_ID_ENV: str(index),
    }
    procs.append(
      subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(flags(fresh)), json.dumps(flags(resumed))],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-4000:]
  for config in (fresh, resumed):
    saved = checkpoint.TrainCheckpoints(config.run_dir)
    assert saved.latest() == 2
    assert_same_training(saved.restore(2, four_devices.state), four_devices.state)
    saved.close()
    rows = [json.loads(line) for line in open(os.path.join(config.run_dir, train_cmd.METRICS_FILE))]
    assert_same_metrics(rows, four_devices.metrics)
  assert "4 devices in 2 process(es)" in outputs[0] and "iteration 2:" in outputs[0]
  assert "iteration 2:" not in outputs[1]  # Process 0 alone reports.
  assert f"resumed {resumed.run_dir} at iteration 1" in outputs[0]


def test_self_play_needs_no_communication_and_the_update_all_reduces_gradients(four_devices):
  mesh = train.data_mesh(4)
  suite = train.replicate(train_cmd.build_suite(SMOKE)[1], mesh)
  state = four_devices.state
  module = parse_module(train.iteration.lower(state, suite, SMOKE.train, mesh).compile().as_text())
  found = module_collectives(module, (train.DATA_AXIS,), (4,))
  where = [
    re.search(r'op_name="([^"]*)"', inst.attrs).group(1)
    for body in module.bodies.values()
    for inst in body
    if inst.opcode.removesuffix("-start") in COLLECTIVE_KINDS
  ]
  assert len(where) == len(found) and all(c.mesh_axes == (train.DATA_AXIS,) for c in found)
  # Self-play: one all-gather of every field of the episodes, packed in one buffer, and not
  # even the conditions of mctx's while loops (each device's loops stop when its own
  # episodes are done).
  in_self_play = [c for c, name in zip(found, where) if "self_play" in name]
  episodes = train.self_play(
    state.params,
    suite,
    jnp.zeros(SMOKE.train.episodes, jnp.int32),
    jnp.zeros(SMOKE.train.episodes, bool),
    jax.random.key(0),
    SMOKE.train,
    mesh,
  )
  episode_bytes = sum(
    x.size * 4 for x in jax.tree.leaves(train.host_copy(episodes))
  )  # bools widened to 32 bits.
  assert [(c.kind, c.bytes) for c in in_self_play] == [("all-gather", episode_bytes)]
  # The update: one all-reduce per optimizer step (inside the scan over the updates) of
  # the parameters' gradients and the loss's parts, packed in one vector.
  gradients = [c for c in found if c.kind == "all-reduce" and c.repeat == SMOKE.train.updates]
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(train.host_copy(state.params)))
  assert len(gradients) == 1 and param_bytes < gradients[0].bytes < param_bytes + 64
  # Each device encodes a quarter of the suite's programs: one all-gather of their
  # embeddings, and one reduce-scatter of the embeddings' gradients, per optimizer step.
  in_updates = sorted(
    c.kind
    for c, name in zip(found, where)
    if "self_play" not in name and c.repeat == SMOKE.train.updates and c.kind != "all-reduce"
  )
  embeddings = jax.eval_shape(lambda p: train.encode_suite(p, suite, SMOKE.train, 1), state.params)
  per_program = sum(
    x.size * 4 // suite.size for x in jax.tree.leaves(embeddings)
  )  # Sent as float32.
  rows = 4 * -(-suite.size // 4)  # Each device's share, the last program repeated to fill it.
  assert in_updates == ["all-gather", "reduce-scatter"]
  assert [c.bytes for c in found if c.kind == "all-gather" and c.repeat == SMOKE.train.updates] == [
    rows * per_program
  ]


@pytest.mark.parametrize(
  "argv, message",
  [
    (
      ["--devices", "8", "--train.episodes", "4"],
      "--train.episodes 4 does not split over the 8 devices",
    ),
    (
      ["--devices", "2", "--train.batch-size", "15"],
      "--train.batch-size 15 does not split over the 2 devices",
    ),
    (
      ["--devices", "9"],
      "--devices 9: give a multiple of the 1 process(es), at most the 8 devices",
    ),
    (
      ["--distributed.num-processes", "2"],
      "needs --distributed.coordinator-address and --distributed.process-id",
    ),
  ],
)
def test_work_the_devices_do_not_divide_is_refused(argv, message, capsys, tmp_path):
  assert cli.main(["train", "--preset", "smoke", "--run-dir", str(tmp_path), *argv]) == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("automap-rl train: error:") and message in line


def test_a_preset_fits_the_devices_it_is_given(four_devices, tmp_path, capsys):
  """`train --preset smoke` on 8 devices: its 4 episodes run on 4 of them (the same
  training as `--devices 4`, bit for bit) and one line says so; with `--devices 8` its
  sizes are rounded up instead."""
  argv = flags(dataclasses.replace(SMOKE, run_dir=str(tmp_path)))
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "--preset smoke: 4 of the 8 devices, the most that split its 4 episodes" in out
  assert "4 devices in 1 process(es)" in out
  rows = [json.loads(line) for line in open(tmp_path / train_cmd.METRICS_FILE)]
  strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
  assert strip(rows) == strip(four_devices.metrics)
  rounded, line = train_cmd.fit_devices(dataclasses.replace(SMOKE, devices=8))
  assert (rounded.train.episodes, rounded.train.batch_size, rounded.devices) == (8, 16, 8)
  assert "its 4 episodes and minibatch of 16 rounded up to 8 and 16" in line
  given = cli.parse("train", ["--preset", "smoke", "--train.episodes", "4"])
  assert train_cmd.fit_devices(given) == (given, None) and not given.fit_devices


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
  config = dataclasses.replace(SMOKE, run_dir=str(tmp_path), wandb="offline")
  first = train_cmd.wandb_run(config)
  first.finish()
  time.sleep(
    1.0
  )  # wandb names a part's directory by its start second: two parts in one second share one.
  again = train_cmd.wandb_run(config)
  again.finish()
  with open(tmp_path / train_cmd.WANDB_ID_FILE) as f:
    assert again.id == first.id == f.read()
  assert (
    len([d for d in os.listdir(tmp_path / "wandb") if d.endswith(first.id)]) == 2
  )  # Both parts, for `wandb sync`.


def test_a_packed_all_gather_and_mean_are_the_leafwise_ones():
  """`agents.packed` moves a tree of mixed dtypes and gathered axes as one buffer; the
  result is, leaf by leaf and bit for bit, what a collective per leaf gives."""
  from jax.sharding import PartitionSpec as P

  from agents import packed

  rng = np.random.default_rng(0)
  tree = {
    "f32": rng.normal(size=(3, 8, 2)).astype(np.float32),
    "i32": rng.integers(-9, 9, 8).astype(np.int32),
    "pred": rng.random((2, 8)) < 0.5,
    "tiny": np.float32([1e-40, -0.0, np.inf, np.nan, 1, 2, 3, 4]),
  }
  axes = {"f32": 1, "i32": 0, "pred": 1, "tiny": 0}
  mesh = train.data_mesh(4)
  specs = {k: P(*([None] * a), train.DATA_AXIS) for k, a in axes.items()}
  gather = jax.shard_map(
    lambda t: packed.all_gather(t, train.DATA_AXIS, axes),
    mesh=mesh,
    in_specs=(specs,),
    out_specs=P(),
    check_vma=False,
  )
  for k, x in jax.jit(gather)(tree).items():
    assert x.dtype == tree[k].dtype
    np.testing.assert_array_equal(np.asarray(x), tree[k])
  floats = {
    "a": rng.normal(size=(4, 5)).astype(np.float32),
    "b": rng.normal(size=(4,)).astype(np.float32),
  }
  mean = jax.shard_map(
    lambda t: packed.pmean(t, train.DATA_AXIS),
    mesh=mesh,
    in_specs=(P(train.DATA_AXIS),),
    out_specs=P(),
    check_vma=False,
  )
  leafwise = jax.shard_map(
    lambda t: jax.lax.pmean(t, train.DATA_AXIS),
    mesh=mesh,
    in_specs=(P(train.DATA_AXIS),),
    out_specs=P(),
    check_vma=False,
  )
  for got, want in zip(
    jax.tree.leaves(jax.jit(mean)(floats)), jax.tree.leaves(jax.jit(leafwise)(floats))
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
