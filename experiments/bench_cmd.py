"""`automap-rl bench simulator|env ...`: throughput benchmarks, ratios measured in one run.

Each prints the headline figures of one workload on one mesh; the batched figure is
measured `--repeats` times, alternating the tables as every problem compiled them before
buckets (exact sizes, compiled in as constants) with the tables as searches now run them
(padded to their buckets, passed as arguments: `automap_rl.buckets`), and the median ratio
of the two is the cost of sharing compiles. Then how the time per
evaluation (step) grows with the program's size (ops, at the headline mesh) and with the
mesh's (devices, at the headline workload), as a table and, with `--plot`, a log-log plot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from automap_rl import workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem, bucketed_costs
from envs.bench import batched_rate, bench_env
from envs.config import EnvConfig
from experiments.cli import write_json
from experiments.options import Hardware, JsonPath, MeshSpec, PlotPath, Workload

SCALE_WORKLOADS = ("gpt:layers=2", "gpt:layers=4", "gpt:layers=8", "gpt:layers=12", "gpt:layers=24")
SCALE_MESHES = (
  "data=2,model=2",
  "data=2,model=4",
  "data=4,model=4",
  "data=4,model=8",
  "data=8,model=8",
)


@dataclasses.dataclass(frozen=True)
class EnvBenchConfig:
  """Environment steps per second: one environment, and a vmapped batch of them, with
  terminal rewards (a step simulates only when its episode ends) and, for the ratio,
  shaped ones (every step simulates).

  Attributes:
    workload: the workload spec.
    mesh: the mesh spec.
    hardware: the hardware profile.
    batch: environments (plans) per vmapped call.
    seconds: how long to time each headline figure.
    seed: seed of the random actions (plans).
    json: where to write the figures.
    scale_workloads: workloads of the program-size scaling rows (at `mesh`).
    scale_meshes: meshes of the mesh-size scaling rows (at `workload`).
    scale_seconds: how long to time each scaling row (batched only).
    plot: where to draw the scaling plot.
    repeats: batched measurements of exact and of bucketed tables, alternating.
  """

  workload: Workload = "gpt:layers=12"
  mesh: MeshSpec = "data=2,model=4"
  hardware: Hardware = "h100"
  batch: int = 256
  seconds: float = 3.0
  seed: int = 0
  json: JsonPath = None
  scale_workloads: tuple[str, ...] = SCALE_WORKLOADS
  scale_meshes: tuple[str, ...] = SCALE_MESHES
  scale_seconds: float = 1.0
  plot: PlotPath = None
  repeats: int = 3

  def __post_init__(self):
    if self.repeats < 1:
      raise ValueError(f"repeats={self.repeats}: the exact and bucketed tables need a run each.")


@dataclasses.dataclass(frozen=True)
class SimulatorBenchConfig(EnvBenchConfig):
  """Simulator evaluations per second: one plan per call, and a vmapped batch of plans.

  Attributes:
    decisions: decisions per random plan.
  """

  decisions: int = 16


def calls_per_second(fn: Callable[[], Any], seconds: float) -> float:
  """Calls of `fn` per second after one warm-up call, blocking on every result."""
  jax.block_until_ready(fn())
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    jax.block_until_ready(fn())
    calls += 1
  return calls / (time.perf_counter() - start)


def random_plans(
  problem: Problem, key: jax.Array, batch: int, length: int
) -> tuple[jax.Array, jax.Array]:
  """`batch` random decision lists of (named dim, axis), int32 [batch, length] each."""
  class_key, axis_key = jax.random.split(key)
  classes = jax.random.randint(class_key, (batch, length), 0, max(len(problem.named.classes), 1))
  axes = jax.random.randint(axis_key, (batch, length), 0, len(problem.mesh.axis_sizes))
  return classes.astype(jnp.int32), axes.astype(jnp.int32)


def build_problem(workload: str, mesh: str, hardware: str) -> Problem:
  return Problem.build(
    workloads.make_workload(workload, abstract=True).trace(), make_mesh(mesh, hardware)
  )


def _size(problem: Problem) -> dict[str, Any]:
  return {
    "ops": problem.program.num_ops,
    "value_signatures": len(problem.sigs.value_keys),
    "op_signatures": len(problem.sigs.op_keys),
    "devices": problem.mesh.num_devices,
  }


def batched_simulator(
  problem: Problem, config: SimulatorBenchConfig, bucketed: bool
) -> Callable[[float], float]:
  """A function of seconds that measures evaluations (resolution and simulation) per second
  of `config.batch` random plans per vmapped call for about that long, compiled once.
  `bucketed`: on the problem's bucketed tables, passed as arguments (`bucketed_costs`, as
  `Problem.costs` runs it); else on exact tables compiled in."""
  classes, axes = random_plans(problem, jax.random.key(config.seed), config.batch, config.decisions)
  if bucketed:
    tables = problem.bucketed
    call = lambda: bucketed_costs(tables, classes, axes)
  else:
    batched = jax.jit(jax.vmap(problem.evaluate))
    call = lambda: batched(classes, axes)
  return lambda seconds: config.batch * calls_per_second(call, seconds)


def simulator_rates(
  problem: Problem, config: SimulatorBenchConfig, seconds: float, single: bool
) -> dict[str, float]:
  """Evaluations per second of `config.batch` random plans per vmapped call and, if
  `single`, of one plan per call, on exact tables."""
  out = {"per_second_batched": batched_simulator(problem, config, False)(seconds)}
  if single:
    classes, axes = random_plans(problem, jax.random.key(config.seed), 1, config.decisions)
    one = jax.jit(problem.evaluate)
    out["per_second_single"] = calls_per_second(lambda: one(classes[0], axes[0]), seconds)
  return out


def _scaling(rate: Callable[[Problem], float], config: EnvBenchConfig) -> list[dict[str, Any]]:
  """One row per scaling workload (at `config.mesh`) and mesh (at `config.workload`):
  sizes, the batched rate, microseconds per evaluation and nanoseconds per op."""
  rows = []
  cases = [(w, config.mesh, "ops") for w in config.scale_workloads]
  cases += [(config.workload, m, "devices") for m in config.scale_meshes]
  for workload, mesh, varies in cases:
    problem = build_problem(workload, mesh, config.hardware)
    per_second = rate(problem)
    size = _size(problem)
    rows.append(
      {
        "varies": varies,
        "workload": workload,
        "mesh": mesh,
        **size,
        "per_second_batched": per_second,
        "us_per_eval": 1e6 / per_second,
        "ns_per_op": 1e9 / per_second / size["ops"],
      }
    )
    print(
      f"  {varies:>7}  {workload:<16} {mesh:<16} {size['ops']:>6} ops {size['devices']:>3} devices "
      f"{per_second:>12,.0f}/s {1e6 / per_second:8.2f} us {rows[-1]['ns_per_op']:7.2f} ns/op",
      flush=True,
    )
  return rows


def growth(rows: list[dict[str, Any]], varies: str) -> float:
  """The exponent k of time per evaluation ~ size**k between the smallest and the largest
  row that vary `varies` (1: linear)."""
  part = sorted((r for r in rows if r["varies"] == varies), key=lambda r: r[varies])
  if len(part) < 2 or part[0][varies] == part[-1][varies]:
    return float("nan")
  return math.log(part[-1]["us_per_eval"] / part[0]["us_per_eval"]) / math.log(
    part[-1][varies] / part[0][varies]
  )


def table(rows: list[dict[str, Any]], unit: str) -> str:
  """The scaling rows as a Markdown table."""
  lines = [
    f"| workload | mesh | ops | devices | {unit}/s batched | us per {unit} | ns per op |",
    "|---" * 7 + "|",
  ]
  for r in rows:
    lines.append(
      f"| {r['workload']} | {r['mesh']} | {r['ops']} | {r['devices']} | "
      f"{r['per_second_batched']:,.0f} "
      f"| {r['us_per_eval']:.2f} | {r['ns_per_op']:.2f} |"
    )
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], unit: str, title: str, path: str) -> None:
  """Microseconds per evaluation against ops and against devices (log-log), each with the
  linear growth through its first point for reference."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
  for ax, varies in zip(axes, ("ops", "devices")):
    part = sorted((r for r in rows if r["varies"] == varies), key=lambda r: r[varies])
    if not part:
      continue
    xs, ys = [r[varies] for r in part], [r["us_per_eval"] for r in part]
    ax.plot(xs, ys, "o-", label=f"measured (exponent {growth(rows, varies):.2f})")
    ax.plot(xs, [ys[0] * x / xs[0] for x in xs], "--", color="gray", label="linear")
    for r in part:
      ax.annotate(
        r["workload"] if varies == "ops" else r["mesh"], (r[varies], r["us_per_eval"]), fontsize=6
      )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(varies)
    ax.set_ylabel(f"us per {unit} (batched)")
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _finish(
  result: dict[str, Any], unit: str, title: str, config: EnvBenchConfig
) -> dict[str, Any]:
  rows = result["scaling"]
  result["growth_exponent"] = {"ops": growth(rows, "ops"), "devices": growth(rows, "devices")}
  print(table(rows, unit))
  print(json.dumps({k: v for k, v in result.items() if k != "scaling"}, indent=1))
  write_json(config.json, result)
  if config.plot:
    plot(rows, unit, title, config.plot)
  return result


def tables_ab(
  rate: Callable[[bool], Callable[[float], float]], seconds: float, repeats: int
) -> dict[str, Any]:
  """Rates on exact and on bucketed tables, each `rate(bucketed)` built (and compiled) once
  and then timed for `seconds`, `repeats` times in turn: the rates, their medians and the
  median of the per-pair ratios, bucketed over exact."""
  timed = {False: rate(False), True: rate(True)}
  exact, bucketed = [], []
  for _ in range(repeats):
    exact.append(timed[False](seconds))
    bucketed.append(timed[True](seconds))
  ratios = [b / e for e, b in zip(exact, bucketed)]
  out = {
    "exact": exact,
    "bucketed": bucketed,
    "bucketed_over_exact": statistics.median(ratios),
    "ratio_range": [min(ratios), max(ratios)],
  }
  low, high = out["ratio_range"]
  print(
    f"exact tables {statistics.median(exact):,.0f}/s, "
    f"bucketed {statistics.median(bucketed):,.0f}/s: bucketed / exact "
    f"{out['bucketed_over_exact']:.3f} (pairs {low:.3f}-{high:.3f}, {repeats} alternating)",
    flush=True,
  )
  return out


def run_simulator(config: SimulatorBenchConfig) -> dict[str, Any]:
  """Cost evaluations per second, one plan per call and a vmapped batch per call, then the
  scaling rows."""
  problem = build_problem(config.workload, config.mesh, config.hardware)
  rates = simulator_rates(problem, config, config.seconds, single=True)
  result = {
    "workload": config.workload,
    "mesh": config.mesh,
    "batch": config.batch,
    "decisions": config.decisions,
    **_size(problem),
    "evals_per_second_single": rates["per_second_single"],
    "evals_per_second_batched": rates["per_second_batched"],
    "tables": tables_ab(
      lambda bucketed: batched_simulator(problem, config, bucketed), config.seconds, config.repeats
    ),
  }
  result["scaling"] = _scaling(
    lambda p: simulator_rates(p, config, config.scale_seconds, single=False)["per_second_batched"],
    config,
  )
  return _finish(
    result, "eval", f"simulator, batch {config.batch}, {config.decisions} decisions", config
  )


def run_env(config: EnvBenchConfig) -> dict[str, Any]:
  """Random-agent environment steps per second with terminal and with shaped rewards (the
  ratio from this one run), then the scaling rows (terminal rewards)."""
  problem = build_problem(config.workload, config.mesh, config.hardware)
  env_config = EnvConfig()
  result = {
    "workload": config.workload,
    "mesh": config.mesh,
    "batch": config.batch,
    **_size(problem),
    "action_space": env_config.action_space,
  }
  for reward in ("terminal", "shaped"):
    rates = bench_env(
      problem, config.batch, config.seconds, dataclasses.replace(env_config, reward=reward)
    )
    result[f"steps_per_second_single_{reward}"] = rates["steps_per_second_single"]
    result[f"steps_per_second_batched_{reward}"] = rates["steps_per_second_batched"]
  result["batched_terminal_over_shaped"] = (
    result["steps_per_second_batched_terminal"] / result["steps_per_second_batched_shaped"]
  )
  terminal = dataclasses.replace(env_config, reward="terminal")
  result["tables"] = tables_ab(
    lambda bucketed: batched_rate(problem, config.batch, terminal, bucketed),
    config.seconds,
    config.repeats,
  )
  result["scaling"] = _scaling(
    lambda p: bench_env(p, config.batch, config.scale_seconds, terminal, single=False)[
      "steps_per_second_batched"
    ],
    config,
  )
  return _finish(
    result, "step", f"environment (terminal rewards, groups), batch {config.batch}", config
  )
