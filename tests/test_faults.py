"""Training that survives faults: a save killed at each of its points, a torn checkpoint, a
SIGTERM (one process, and both of a two-process run), one of two processes killed. After
each, the run resumed (every process restarted on the same run directory) ends with the
parameters, optimizer state, buffer and key of an uninterrupted run of the same seed and
process layout, bit for bit, and its metrics file holds each iteration once.

The runs are the smoke preset without pipeline options (`test_distributed.SMOKE`), 3
iterations, a checkpoint after each. Faults are injected in subprocesses: SIGKILL at a
named point of the save (`agents.checkpoint.kill_point`), SIGTERM and SIGKILL from here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from agents import checkpoint, train
from experiments import distributed, train_cmd
from experiments.distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

_PRESET = train_cmd.PRESETS["smoke"]
SMOKE = dataclasses.replace(
  _PRESET,
  iterations=3,
  wandb="disabled",
  progress=False,
  learning_curve=False,
  devices=1,
  train=dataclasses.replace(
    _PRESET.train, network=dataclasses.replace(_PRESET.train.network, pipelines=0)
  ),
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = "import sys\nfrom experiments import cli\nsys.exit(cli.main(sys.argv[1:]))\n"
PEER_TIMEOUT = 10  # Seconds; the default is 60.


def flags(run_dir: str, devices: int | None = 1) -> list[str]:
  """`automap-rl train` flags of SMOKE into `run_dir` (`devices` None: every device)."""
  return [
    "train",
    "--preset",
    "smoke",
    "--iterations",
    str(SMOKE.iterations),
    "--run-dir",
    run_dir,
    "--wandb",
    "disabled",
    "--no-progress",
    "--no-learning-curve",
    "--train.network.pipelines",
    "0",
    "--distributed.peer-timeout",
    str(PEER_TIMEOUT),
    *([] if devices is None else ["--devices", str(devices)]),
  ]


def start(run_dir: str, processes: int = 1, env: dict | None = None) -> list[subprocess.Popen]:
  """`automap-rl train` of SMOKE in `processes` processes (2 devices each when several);
  `env[i]`: process i's extra environment."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = []
  for index in range(processes):
    extra = {}
    if processes > 1:
      extra = {
        "XLA_FLAGS": os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=2"),
        COORDINATOR_ENV: f"localhost:{port}",
        NUM_PROCESSES_ENV: str(processes),
        PROCESS_ID_ENV: str(index),
      }
    procs.append(
      subprocess.Popen(
        [sys.executable, "-c", WORKER, *flags(run_dir, 1 if processes == 1 else None)],
        cwd=ROOT,
        env={**os.environ, **extra, **(env or {}).get(index, {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  return procs


def outputs(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
  """Each process's exit status and output, once it ends."""
  done = [p.communicate(timeout=timeout)[0] for p in procs]
  return [(p.returncode, out) for p, out in zip(procs, done)]


def wait_for_iteration(run_dir: str, iteration: int, procs: list[subprocess.Popen]) -> None:
  """Waits until the metrics file holds `iteration` (the processes still running)."""
  path = os.path.join(run_dir, train_cmd.METRICS_FILE)
  while not (os.path.exists(path) and len(open(path).readlines()) >= iteration):
    assert all(p.poll() is None for p in procs), "a process ended before the fault"
    time.sleep(0.1)


def leaves(state: train.TrainState) -> list[np.ndarray]:
  """The leaves of a state (global arrays, or numpy) as numpy arrays."""
  return [
    np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
    for x in jax.tree.leaves(state)
  ]


def saved_state(run_dir: str, target: train.TrainState) -> tuple[int, list[np.ndarray]]:
  """The newest checkpoint of `run_dir`: its iteration and leaves (restored in this process)."""
  saved = checkpoint.TrainCheckpoints(run_dir)
  iteration, state = saved.restore_latest(target)
  saved.close()
  return iteration, leaves(state)


def assert_resumed_as_uninterrupted(run_dir: str, reference: train_cmd.TrainResult) -> None:
  """The run in `run_dir` ended with `reference`'s state, bit for bit, and its metrics file
  holds iterations 1..3 once each, with `reference`'s values."""
  iteration, saved = saved_state(run_dir, reference.state)
  assert iteration == SMOKE.iterations
  for x, y in zip(saved, leaves(reference.state), strict=True):
    np.testing.assert_array_equal(x, y)
  rows = [json.loads(line) for line in open(os.path.join(run_dir, train_cmd.METRICS_FILE))]
  strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
  assert strip(rows) == strip(reference.metrics)
  assert [r["iteration"] for r in rows] == [1, 2, 3]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> train_cmd.TrainResult:
  """SMOKE run in this process without a fault (on 1 device, as its subprocesses)."""
  return train_cmd.run(dataclasses.replace(SMOKE, run_dir=str(tmp_path_factory.mktemp("whole"))))


@pytest.fixture(scope="module")
def uninterrupted_two(tmp_path_factory) -> str:
  """SMOKE run by two processes of two devices each without a fault: its run directory."""
  run_dir = str(tmp_path_factory.mktemp("whole_two"))
  for code, out in outputs(start(run_dir, processes=2)):
    assert code == 0, out[-3000:]
  return run_dir


def test_a_torn_checkpoint_is_skipped_with_a_warning(uninterrupted, tmp_path, capsys):
  """The newest checkpoint's array data truncated: it is not loaded; the one before it is,
  and the run continues to the uninterrupted run's state."""
  run_dir = str(tmp_path / "run")
  shutil.copytree(uninterrupted.run_dir, run_dir)
  data = os.path.join(run_dir, checkpoint.CHECKPOINTS_DIR, "3", checkpoint.STATE_ITEM, "d")
  for name in os.listdir(data):
    with open(os.path.join(data, name), "r+b") as f:
      f.truncate(os.path.getsize(f.name) // 2)
  result = train_cmd.run(dataclasses.replace(SMOKE, run_dir=run_dir))
  out, err = capsys.readouterr()
  assert "warning: skipping a torn checkpoint: checkpoint" in err and "/3 " in err
  assert f"resumed {run_dir} at iteration 2" in out
  assert int(result.state.iteration) == 3
  assert_resumed_as_uninterrupted(run_dir, uninterrupted)


def test_a_checkpoint_that_restores_to_other_bytes_is_skipped(uninterrupted, tmp_path):
  """A checkpoint whose digests do not match its arrays is refused by `restore`."""
  run_dir = str(tmp_path / "run")
  shutil.copytree(uninterrupted.run_dir, run_dir)
  record = os.path.join(run_dir, checkpoint.CHECKPOINTS_DIR, "3", checkpoint.SAVED_FILE)
  saved = json.load(open(record))
  saved["sha256"][0] = "0" * 64
  json.dump(saved, open(record, "w"))
  assert saved_state(run_dir, uninterrupted.state)[0] == 2


KILL_POINTS = ["save-begin", "save-written", "save-committed", "policy-written"]


@pytest.mark.parametrize(
  "point",
  [pytest.param(p, marks=[] if p == "save-written" else pytest.mark.slow) for p in KILL_POINTS],
)
def test_a_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(
  point, uninterrupted, tmp_path
):
  run_dir = str(tmp_path / "run")
  ((code, out),) = outputs(start(run_dir, env={0: {checkpoint.KILL_ENV: f"{point}:2"}}))
  assert code == -signal.SIGKILL, out[-3000:]
  complete = 2 if point in ("save-committed", "policy-written") else 1
  assert checkpoint.TrainCheckpoints(run_dir).latest() == complete
  result = train_cmd.run(dataclasses.replace(SMOKE, run_dir=run_dir))
  assert int(result.state.iteration) == 3
  assert_resumed_as_uninterrupted(run_dir, uninterrupted)
  assert sorted(os.listdir(os.path.join(run_dir, checkpoint.CHECKPOINTS_DIR))) == ["2", "3"]
  params = checkpoint.load_params(run_dir, uninterrupted.state.params)  # The final policy.
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(uninterrupted.state.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_sigterm_saves_at_the_next_iteration_and_exits_0(uninterrupted, tmp_path):
  run_dir = str(tmp_path / "run")
  procs = start(run_dir)
  wait_for_iteration(run_dir, 1, procs)
  procs[0].send_signal(signal.SIGTERM)
  ((code, out),) = outputs(procs)
  assert code == 0, out[-3000:]
  saved = checkpoint.TrainCheckpoints(run_dir).latest()
  assert saved in (1, 2)
  where = os.path.join(run_dir, checkpoint.CHECKPOINTS_DIR, str(saved))
  assert f"preempted: process 0 saved iteration {saved} in {where}" in out
  train_cmd.run(dataclasses.replace(SMOKE, run_dir=run_dir))
  assert_resumed_as_uninterrupted(run_dir, uninterrupted)


def two_process_reference(run_dir: str, uninterrupted: train_cmd.TrainResult):
  """The two-process uninterrupted run's final state and metrics, as a `TrainResult`."""
  _, saved = saved_state(run_dir, uninterrupted.state)
  state = jax.tree.unflatten(jax.tree.structure(uninterrupted.state), saved)
  rows = [json.loads(line) for line in open(os.path.join(run_dir, train_cmd.METRICS_FILE))]
  return train_cmd.TrainResult(run_dir=run_dir, state=state, metrics=rows)


@pytest.mark.slow
def test_sigterm_to_a_two_process_run_saves_one_step_in_both(
  uninterrupted, uninterrupted_two, tmp_path
):
  run_dir = str(tmp_path / "run")
  procs = start(run_dir, processes=2)
  wait_for_iteration(run_dir, 1, procs)
  for p in procs:
    p.send_signal(signal.SIGTERM)
  done = outputs(procs)
  saved = checkpoint.TrainCheckpoints(run_dir).latest()
  where = os.path.join(run_dir, checkpoint.CHECKPOINTS_DIR, str(saved))
  for index, (code, out) in enumerate(done):
    assert code == 0, out[-3000:]
    assert f"preempted: process {index} saved iteration {saved} in {where}" in out
  for code, out in outputs(start(run_dir, processes=2)):
    assert code == 0, out[-3000:]
  assert_resumed_as_uninterrupted(run_dir, two_process_reference(uninterrupted_two, uninterrupted))


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0])
def test_a_lost_process_ends_the_other_and_a_restart_resumes(
  lost, uninterrupted, uninterrupted_two, tmp_path
):
  """Process 1 lost: the watch of process 0 names it at the timeout. Process 0 lost, its
  coordination service with it: JAX's client in process 1 aborts at once, and the watch's
  abort handler names process 0. Either way the survivor's last line is the one error line,
  and it exits with status 1."""
  run_dir = str(tmp_path / "run")
  procs = start(run_dir, processes=2)
  wait_for_iteration(run_dir, 1, procs)
  procs[lost].kill()
  killed = time.monotonic()
  survivor = procs[1 - lost]
  out = survivor.communicate(timeout=PEER_TIMEOUT + 30)[0]
  waited = time.monotonic() - killed
  procs[lost].wait()
  assert waited < PEER_TIMEOUT + 5  # The watch's timeout, and the process's exit.
  assert survivor.returncode == 1, out[-3000:]
  errors = [line for line in out.splitlines() if line.startswith("automap-rl: error:")]
  assert errors == out.splitlines()[-1:], out[-3000:]
  why = "no sign of life for 10 s" if lost == 1 else "its coordination service at localhost:"
  what = " (the coordinator)" if lost == 0 else ""
  assert errors[0].startswith(f"automap-rl: error: lost process {lost}{what} of 2: {why}")
  for code, out in outputs(start(run_dir, processes=2)):
    assert code == 0, out[-3000:]
  assert_resumed_as_uninterrupted(run_dir, two_process_reference(uninterrupted_two, uninterrupted))


ABORTING = """import os, sys
from experiments import distributed
def callback():
  if sys.argv[1] == "end":
    os.write(2, b"ended by the handler\\n")
    os._exit(3)
handler = distributed.on_abort(callback)
os.abort()
"""


@pytest.mark.parametrize("how", ["end", "go-on"])
def test_the_abort_handler_runs_before_an_abort_and_may_end_the_process(how):
  """`on_abort`'s callback runs when C's `abort()` is called (as JAX's client calls it):
  one that exits ends the process with its status; one that returns lets the abort end it."""
  done = subprocess.run(
    [sys.executable, "-c", ABORTING, how], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  if how == "end":
    assert (done.returncode, done.stderr.splitlines()[-1]) == (3, "ended by the handler")
  else:
    assert done.returncode == -signal.SIGABRT, done.stderr[-3000:]


def test_reachable_tells_a_listening_port_from_a_closed_one():
  with socket.socket() as listening:
    listening.bind(("localhost", 0))
    listening.listen()
    address = f"localhost:{listening.getsockname()[1]}"
    assert distributed.reachable(address, 5.0)
  assert not distributed.reachable(address, 5.0)


def test_wandb_gets_each_iteration_once_across_a_resume(tmp_path):
  """Iterations reach wandb when checkpointed; after a resume from iteration 2, the rerun
  third iteration is logged once, the first two not again."""
  logged = []

  class Logger:
    def log(self, values, step):
      logged.append(step)

  rows = [{"iteration": i, "score": float(i)} for i in (1, 2, 3)]
  train_cmd._log_wandb(Logger(), str(tmp_path), rows[:1], 1)
  train_cmd._log_wandb(Logger(), str(tmp_path), rows[:2], 2)
  # Killed after iteration 3's metrics, before its checkpoint: the resume logs up to 2 ...
  train_cmd._log_wandb(Logger(), str(tmp_path), rows[:2], 2)
  train_cmd._log_wandb(Logger(), str(tmp_path), rows, 3)  # ... then the rerun third.
  assert logged == [1, 2, 3]
