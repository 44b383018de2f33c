"""`automap-rl bench step`: measured training-step times on the local accelerator against
the simulator's.

For each workload: the simulator prices the unpartitioned training step (the one-device
plan) on a one-device mesh of `--hardware`; where it fits, the step is built with real
arrays on the default device, compiled with its state donated and timed step by step
(`automap_rl.xla.measure.time_step`). A row gives measured over simulated step time, the
flop/s the step reached against the profile's peak, and the compiled module's flops and
peak memory against the simulator's. A workload whose simulated peak does not fit the
profile is not built, and the row says so. On a CPU the measured times mean nothing for an
accelerator profile; the command is for a machine with the accelerator the profile names.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any

import jax

from automap_rl.mesh import make_mesh
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
    json: where to write the rows.
    plot: where to draw measured against simulated step times.
  """

  workloads: tuple[str, ...] = DEFAULT_WORKLOADS
  hardware: Hardware = "h100"
  repeats: int = 10
  warmup: int = 3
  seed: int = 0
  json: JsonPath = None
  plot: PlotPath = None


def measure_workload(spec: str, config: StepBenchConfig) -> dict[str, Any]:
  """One row: the workload's simulated one-device cost and, where it fits, its measured step."""
  program = make_workload(spec, config.seed, abstract=True).trace()
  problem = Problem.build(program, make_mesh("data=1", config.hardware))
  cost = jax.device_get(problem.cost([]))
  hardware = problem.mesh.hardware
  row: dict[str, Any] = {
      "workload": spec, "hardware": config.hardware, "ops": len(program.ops),
      "simulated_ms": 1e3 * float(cost.step_time),
      "simulated_flops": simulated_flops(problem, problem.resolution([])),
      "simulated_peak_gib": float(cost.peak_memory) / 2**30,
      "simulated_fits": bool(cost.fits),
  }
  if not cost.fits:
    row["skipped"] = f"simulated peak {row['simulated_peak_gib']:.1f} GiB does not fit the {config.hardware} profile"
    return row
  try:
    workload = make_workload(spec, config.seed)
    timing = time_step(workload.step, workload.args, len(workload.args) - 1, repeats=config.repeats,
                       warmup=config.warmup)
  except jax.errors.JaxRuntimeError as error:  # Out of device memory where the simulator said it fits.
    row["skipped"] = f"failed on the device: {str(error).splitlines()[0][:160]}"
    return row
  peak_flops = max(hardware.flops.values())
  row.update({
      "device": timing.device, "measured_ms": 1e3 * timing.seconds, "fastest_ms": 1e3 * timing.fastest,
      "slowest_ms": 1e3 * timing.slowest, "steps": timing.steps,
      "measured_over_simulated": timing.seconds / float(cost.step_time),
      "compiled_flops": timing.compiled.flops,
      "compiled_peak_gib": timing.compiled.peak_bytes / 2**30,
      "achieved_tflops": timing.compiled.flops / timing.seconds / 1e12,
      "fraction_of_peak": timing.compiled.flops / timing.seconds / peak_flops,
  })
  return row


def table(rows: list[dict[str, Any]]) -> str:
  """The rows as a Markdown table."""
  lines = ["| workload | measured ms | simulated ms | measured / simulated "
           "| TFLOP/s (of peak) | compiled / simulated flops | compiled / simulated peak GiB |", "|---" * 7 + "|"]
  for r in rows:
    if "skipped" in r:
      lines.append(f"| {r['workload']} | not run: {r['skipped']} | {r['simulated_ms']:.1f} | - | - | - | - |")
      continue
    lines.append(
        f"| {r['workload']} | {r['measured_ms']:.1f} ({r['fastest_ms']:.1f}-{r['slowest_ms']:.1f}) "
        f"| {r['simulated_ms']:.1f} | {r['measured_over_simulated']:.2f} "
        f"| {r['achieved_tflops']:.1f} ({100 * r['fraction_of_peak']:.0f}%) "
        f"| {r['compiled_flops'] / r['simulated_flops']:.3f} "
        f"| {r['compiled_peak_gib']:.1f} / {r['simulated_peak_gib']:.1f} |")
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], title: str, path: str) -> None:
  """Measured against simulated step time per workload, log-log, with the diagonal."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  measured = [r for r in rows if "measured_ms" in r]
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


def _summary(rows: list[dict[str, Any]], hardware: str) -> dict[str, Any]:
  """The device, how many rows were measured and their median measured / simulated ratio."""
  ratios = [r["measured_over_simulated"] for r in rows if "measured_over_simulated" in r]
  return {"device": jax.devices()[0].device_kind, "hardware": hardware, "workloads": len(rows),
          "measured": len(ratios), "median_measured_over_simulated": statistics.median(ratios) if ratios else None}


def run(config: StepBenchConfig) -> list[dict[str, Any]]:
  if config.repeats < 1 or config.warmup < 0 or not config.workloads:
    raise ValueError("--repeats must be at least 1, --warmup at least 0, and --workloads name one or more.")
  for spec in config.workloads:  # Bad specs fail before anything is built.
    make_config(spec)
  rows: list[dict[str, Any]] = []
  for spec in config.workloads:
    with phase(f"{spec}: build, simulate, compile, time"):
      rows.append(measure_workload(spec, config))
    summary = _summary(rows, config.hardware)
    write_json(config.json, {"summary": summary, "rows": rows})  # After every row: a long run keeps what it measured.
  print(table(rows))
  print(json.dumps(summary, indent=1))
  if config.plot:
    plot(rows, f"one {summary['device']} against the {config.hardware} profile", config.plot)
  if not summary["measured"]:
    raise CommandFailed("no workload was measured: every one's simulated peak exceeds the device's memory")
  return rows
