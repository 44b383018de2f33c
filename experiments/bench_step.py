"""`automap-rl bench step`: measured training-step times on the local accelerator against
the simulator's.

For each workload: the simulator prices the unpartitioned training step (the one-device
plan) on a one-device mesh of `--hardware`; where it fits, the step is built with real
arrays on the default device, compiled with its state donated and timed step by step
(`automap_rl.xla.measure.time_step`). A row gives measured over simulated step time, the
flop/s the step reached against the profile's bfloat16 peak, and the compiled module's flops and
peak memory against the simulator's. A workload whose simulated peak does not fit the
profile is not built, and the row says so. On a CPU the measured times mean nothing for an
accelerator profile; the command is for a machine with the accelerator the profile names.
Where that machine's jax is not the pinned one the tracer reads, `--no-simulate` measures
only, and `--measured FILE` prices those rows on a machine with the pinned stack.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any

import jax

from automap_rl.mesh import get_hardware, make_mesh
from automap_rl.problem import Problem
from automap_rl.workloads import make_workload
from automap_rl.workloads.spec import make_config
from automap_rl.xla.measure import time_step
from automap_rl.xla.validate import simulated_flops
from experiments.cli import CommandFailed, write_json
from experiments.options import Hardware, JsonPath, PlotPath
from experiments.progress import phase

DEFAULT_WORKLOADS = (
  "gpt:size=350m,batch=16",
  "gpt:size=1.3b,batch=8",
  "gpt:size=1.3b,batch=8,dtype=float32",
  "llama:size=1b,batch=4",
  "t5:size=base,batch=32",
  "vit:size=l16,batch=64",
  "moe:size=380m,batch=16",
  "ssm:size=130m,batch=8",
  "wresnet:size=250m,batch=32",
  "unet:size=ddpm-cifar10,batch=128",
)


@dataclasses.dataclass(frozen=True)
class StepBenchConfig:
  """Measured step times of one-device plans against the simulator's.

  Attributes:
    workloads: workload specs, each built at its size with real arrays on the default device.
    hardware: the simulator's profile for the local device.
    repeats: steps timed per workload.
    warmup: steps run before the timed ones.
    seed: the workloads' parameter and data seed.
    simulate: price each workload with the simulator; `--no-simulate` only measures, for an
      accelerator machine whose jax is not the pinned one the tracer reads (its rows are
      priced later with `--measured`).
    measured: the JSON of an earlier `--no-simulate` run: its rows are priced here instead of
      measuring (its workloads replace `--workloads`).
    json: where to write the rows.
    plot: where to draw measured against simulated step times.
  """

  workloads: tuple[str, ...] = DEFAULT_WORKLOADS
  hardware: Hardware = "h100"
  repeats: int = 10
  warmup: int = 3
  seed: int = 0
  simulate: bool = True
  measured: str | None = None
  json: JsonPath = None
  plot: PlotPath = None


def simulated_row(spec: str, hardware: str, seed: int) -> dict[str, Any]:
  """The simulator's one-device step time, flops and peak memory of a workload (traced
  abstractly: nothing is allocated)."""
  program = make_workload(spec, seed, abstract=True).trace()
  problem = Problem.build(program, make_mesh("data=1", hardware))
  cost = jax.device_get(problem.cost([]))
  return {
    "workload": spec,
    "hardware": hardware,
    "ops": len(program.ops),
    "simulated_ms": 1e3 * float(cost.step_time),
    "simulated_flops": simulated_flops(problem, problem.resolution([])),
    "simulated_peak_gib": float(cost.peak_memory) / 2**30,
    "simulated_fits": bool(cost.fits),
  }


def measured_row(spec: str, config: StepBenchConfig) -> dict[str, Any]:
  """A workload's measured step on the default device, or `failed` with XLA's first line
  (out of device memory, a compiler error)."""
  try:
    workload = make_workload(spec, config.seed)
    timing = time_step(
      workload.step,
      workload.args,
      len(workload.args) - 1,
      repeats=config.repeats,
      warmup=config.warmup,
    )
  except jax.errors.JaxRuntimeError as error:
    return {"workload": spec, "failed": str(error).splitlines()[0][:160]}
  return {
    "workload": spec,
    "device": timing.device,
    "jax": jax.__version__,
    "measured_ms": 1e3 * timing.seconds,
    "fastest_ms": 1e3 * timing.fastest,
    "slowest_ms": 1e3 * timing.slowest,
    "steps": timing.steps,
    "compiled_flops": timing.compiled.flops,
    "compiled_peak_gib": timing.compiled.peak_bytes / 2**30,
  }


def compare(
  simulated: dict[str, Any] | None, measured: dict[str, Any] | None, hardware: str
) -> dict[str, Any]:
  """One row from a workload's simulated and measured figures (either may be missing): the
  measured over simulated step time and the flop/s reached (the program's flops over the
  measured time) against the profile's bfloat16 peak."""
  row = {**(simulated or {}), **(measured or {})}
  if "measured_ms" in row:
    # The program's flops where the simulator counted them: XLA:GPU's cost analysis leaves out
    # library calls (cuDNN convolutions) and counts a loop body once.
    flops = row.get("simulated_flops", row["compiled_flops"])
    row["achieved_tflops"] = flops / row["measured_ms"] / 1e9
    row["fraction_of_peak"] = (
      row["achieved_tflops"] * 1e12 / get_hardware(hardware).flops["bfloat16"]
    )
    if simulated:
      row["measured_over_simulated"] = row["measured_ms"] / row["simulated_ms"]
  return row


def measure_workload(spec: str, config: StepBenchConfig) -> dict[str, Any]:
  """One row: the workload's simulated cost (unless `--no-simulate`) and, where the simulator
  says it fits, its measured step."""
  simulated = simulated_row(spec, config.hardware, config.seed) if config.simulate else None
  if simulated and not simulated["simulated_fits"]:
    return {
      **simulated,
      "failed": f"not run: simulated peak {simulated['simulated_peak_gib']:.1f} GiB "
      f"does not fit the {config.hardware} profile",
    }
  return compare(simulated, measured_row(spec, config), config.hardware)


def _cell(row: dict[str, Any], key: str, form: str) -> str:
  return format(row[key], form) if key in row else "-"


def table(rows: list[dict[str, Any]]) -> str:
  """The rows as a Markdown table."""
  lines = [
    "| workload | measured ms (fastest-slowest) | simulated ms | measured / simulated | TFLOP/s "
    "(of bf16 peak) "
    "| compiled / simulated flops | compiled / simulated peak GiB |",
    "|---" * 7 + "|",
  ]
  for r in rows:
    if "failed" in r:
      lines.append(
        f"| {r['workload']} | {r['failed']} | {_cell(r, 'simulated_ms', '.1f')} | - | - | - | - |"
      )
      continue
    flops = f"{r['compiled_flops'] / r['simulated_flops']:.3f}" if "simulated_flops" in r else "-"
    lines.append(
      f"| {r['workload']} | {r['measured_ms']:.1f} ({r['fastest_ms']:.1f}-{r['slowest_ms']:.1f}) "
      f"| {_cell(r, 'simulated_ms', '.1f')} | {_cell(r, 'measured_over_simulated', '.2f')} "
      f"| {r['achieved_tflops']:.1f} ({100 * r['fraction_of_peak']:.0f}%) | {flops} "
      f"| {r['compiled_peak_gib']:.1f} / {_cell(r, 'simulated_peak_gib', '.1f')} |"
    )
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], title: str, path: str) -> None:
  """Measured against simulated step time per workload, log-log, with the diagonal."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  measured = [r for r in rows if "measured_ms" in r and "simulated_ms" in r]
  fig, ax = plt.subplots(figsize=(5.5, 5))
  xs, ys = [r["simulated_ms"] for r in measured], [r["measured_ms"] for r in measured]
  ax.scatter(xs, ys)
  for r in measured:
    ax.annotate(r["workload"], (r["simulated_ms"], r["measured_ms"]), fontsize=6)
  if measured:
    low, high = min(xs + ys) / 1.5, max(xs + ys) * 1.5
    ax.plot([low, high], [low, high], "--", color="gray", label="measured = simulated")
    ax.legend(fontsize=7)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("simulated step, ms")
  ax.set_ylabel("measured step, ms")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _read_measured(path: str) -> list[dict[str, Any]]:
  """The measured rows of an earlier run's JSON (ValueError naming the file if it has none)."""
  with open(path) as f:
    rows = [r for r in json.load(f).get("rows", []) if "measured_ms" in r]
  if not rows:
    raise ValueError(f"--measured {path}: no measured rows in it")
  return [{k: v for k, v in r.items() if not k.startswith("simulated_")} for r in rows]


def _summary(rows: list[dict[str, Any]], hardware: str) -> dict[str, Any]:
  """The device, how many rows were measured and their median measured / simulated ratio."""
  ratios = [r["measured_over_simulated"] for r in rows if "measured_over_simulated" in r]
  devices = sorted({r["device"] for r in rows if "device" in r})
  return {
    "device": ", ".join(devices) or jax.devices()[0].device_kind,
    "hardware": hardware,
    "workloads": len(rows),
    "measured": sum("measured_ms" in r for r in rows),
    "median_measured_over_simulated": statistics.median(ratios) if ratios else None,
  }


def run(config: StepBenchConfig) -> list[dict[str, Any]]:
  if config.repeats < 1 or config.warmup < 0 or not config.workloads:
    raise ValueError(
      "--repeats must be at least 1, --warmup at least 0, and --workloads name one or more."
    )
  for spec in config.workloads:  # Bad specs fail before anything is built.
    make_config(spec)
  if config.measured and not config.simulate:
    raise ValueError(
      "--measured prices an earlier run's rows: it needs the simulator (drop --no-simulate)."
    )
  rows: list[dict[str, Any]] = []
  work = (
    [(r["workload"], r) for r in _read_measured(config.measured)]
    if config.measured
    else [(spec, None) for spec in config.workloads]
  )
  for spec, measured in work:
    with phase(f"{spec}: {'simulate' if measured else 'build, simulate, compile, time'}"):
      rows.append(
        measure_workload(spec, config)
        if measured is None
        else compare(simulated_row(spec, config.hardware, config.seed), measured, config.hardware)
      )
    summary = _summary(rows, config.hardware)
    write_json(
      config.json, {"summary": summary, "rows": rows}
    )  # After every row: a long run keeps what it measured.
  print(table(rows))
  print(json.dumps(summary, indent=1))
  if config.plot:
    plot(rows, f"one {summary['device']} against the {config.hardware} profile", config.plot)
  if not summary["measured"]:
    raise CommandFailed("no workload was measured: each row says why")
  return rows
