"""`bench step`: measured one-device steps against the simulator's, measured on one machine
and priced on another."""

import json

import jax
import jax.numpy as jnp
import pytest

from automap_rl.xla.measure import time_step
from experiments import bench_step
from experiments.cli import CommandFailed

TINY = "gpt:layers=1,d_model=32,heads=2,seq=16,vocab=64,batch=4"


def test_time_step_carries_the_state_from_step_to_step():
  calls = []

  def step(count, batch):
    jax.debug.callback(lambda c: calls.append(int(c)), count)
    return count + 1, batch.sum()

  timing = time_step(step, (jnp.zeros((), jnp.int32), jnp.ones(3)), carried=1, repeats=3, warmup=2)
  jax.effects_barrier()
  assert calls == [0, 1, 2, 3, 4]  # Each step reads the count the step before it returned.
  assert timing.steps == 3 and 0 < timing.fastest <= timing.seconds <= timing.slowest
  assert timing.compiled.flops > 0


@pytest.mark.parametrize("repeats, warmup, carried", [(0, 1, 1), (1, -1, 1), (1, 1, 3)])
def test_time_step_refuses_what_it_cannot_time(repeats, warmup, carried):
  with pytest.raises(ValueError):
    time_step(
      lambda c, b: (c, b), (jnp.zeros(()), jnp.ones(2)), carried, repeats=repeats, warmup=warmup
    )


def test_rows_measured_without_the_simulator_are_priced_later(tmp_path):
  measured_json, priced_json = tmp_path / "measured.json", tmp_path / "priced.json"
  bench_step.run(
    bench_step.StepBenchConfig(
      workloads=(TINY,),
      hardware="cpu",
      repeats=2,
      warmup=1,
      simulate=False,
      json=str(measured_json),
    )
  )
  [measured] = json.loads(measured_json.read_text())["rows"]
  assert measured["measured_ms"] > 0 and not any(k.startswith("simulated") for k in measured)

  bench_step.run(
    bench_step.StepBenchConfig(hardware="cpu", measured=str(measured_json), json=str(priced_json))
  )
  [priced] = json.loads(priced_json.read_text())["rows"]
  simulated = bench_step.simulated_row(TINY, "cpu", 0)
  assert {k: priced[k] for k in simulated} == simulated
  assert priced["measured_ms"] == measured["measured_ms"]  # Not measured again.
  assert priced["measured_over_simulated"] == measured["measured_ms"] / simulated["simulated_ms"]
  assert priced["achieved_tflops"] == pytest.approx(
    simulated["simulated_flops"] / measured["measured_ms"] / 1e9
  )


def test_a_workload_the_profile_cannot_hold_is_not_built_and_the_command_fails(tmp_path):
  with pytest.raises(CommandFailed, match="no workload was measured"):
    bench_step.run(
      bench_step.StepBenchConfig(
        workloads=("gpt:size=175b",), hardware="cpu", json=str(tmp_path / "rows.json")
      )
    )
  [row] = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert row["failed"].startswith("not run: simulated peak") and "measured_ms" not in row


def test_bad_input_is_refused_before_anything_is_built(tmp_path):
  with pytest.raises(ValueError, match="unknown model"):
    bench_step.run(bench_step.StepBenchConfig(workloads=(TINY, "nosuchmodel")))
  with pytest.raises(ValueError, match="--measured"):
    bench_step.run(bench_step.StepBenchConfig(measured=str(tmp_path / "x.json"), simulate=False))
  (tmp_path / "empty.json").write_text(json.dumps({"rows": [{"workload": TINY, "failed": "oom"}]}))
  with pytest.raises(ValueError, match="no measured rows"):
    bench_step.run(bench_step.StepBenchConfig(measured=str(tmp_path / "empty.json")))
