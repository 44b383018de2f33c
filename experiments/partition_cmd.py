"""`automap-rl partition MODEL --mesh ... --hardware ... --tactic NAME`: a plan and its cost
beside every expert tactic."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from automap_rl import models, tactics
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from automap_rl.simulator import KINDS, Cost
from experiments.inspect_cmd import trace_workload


@dataclasses.dataclass(frozen=True)
class PartitionConfig:
  """What to partition and how.

  Attributes:
    model: zoo spec.
    mesh: mesh spec, e.g. `data=2,model=4`.
    hardware: hardware profile name.
    tactic: the expert tactic that makes the plan.
    json_path: where to write the figures, or None.
    max_args: how many argument shardings to print.
  """

  model: str = "gpt"
  mesh: str = "data=2,model=4"
  hardware: str = "h100"
  tactic: str = "data_megatron"
  json_path: str | None = None
  max_args: int = 12


def cost_dict(cost: Cost) -> dict[str, Any]:
  """The JSON figures of a cost."""
  return {
      "step_time_s": float(cost.step_time),
      "peak_memory_bytes": float(cost.peak_memory),
      "fits": bool(cost.fits),
      "comm_bytes": {k: float(b) for k, b in zip(KINDS, np.asarray(cost.comm_bytes))},
      "comm_count": {k: int(round(float(c))) for k, c in zip(KINDS, np.asarray(cost.comm_count))},
  }


def format_costs(rows: dict[str, dict[str, Any]]) -> str:
  """A table of plans: step time, memory and collectives."""
  lines = [f"{'plan':<16} {'step ms':>9} {'mem/dev MiB':>12} {'fits':>5}  " + "  ".join(f"{k:>16}" for k in KINDS)]
  for name, r in rows.items():
    comm = "  ".join(f"{r['comm_count'][k]:>5}x{r['comm_bytes'][k] / 2**20:>8.1f}MiB" for k in KINDS)
    lines.append(f"{name:<16} {r['step_time_s'] * 1e3:>9.3f} {r['peak_memory_bytes'] / 2**20:>12.1f} "
                 f"{'yes' if r['fits'] else 'NO':>5}  {comm}")
  return "\n".join(lines)


def format_arguments(problem: Problem, decisions, max_args: int) -> str:
  """Per-argument shardings, parameters and inputs first."""
  program = problem.program
  specs = problem.partition_specs(decisions, program.inputs)
  rows = [(program.values[v], s) for v, s in zip(program.inputs, specs) if not program.values[v].path.startswith("opt_state")]
  lines = [f"{'argument':<48} {'shape':<20} sharding"]
  for value, spec in rows[:max_args]:
    lines.append(f"{value.path:<48} {str(list(value.shape)):<20} {tuple(spec)}")
  if len(rows) > max_args:
    lines.append(f"... {len(rows) - max_args} more arguments (optimizer state follows its parameter)")
  return "\n".join(lines)


def baselines(problem: Problem) -> dict[str, dict[str, Any]]:
  """The cost figures of every applicable expert tactic."""
  return {name: cost_dict(problem.cost(plan)) for name, plan in tactics.applicable(problem).items()}


def run(config: PartitionConfig) -> dict[str, Any]:
  if config.tactic not in tactics.TACTICS:
    raise ValueError(f"Unknown tactic {config.tactic!r}; valid: {', '.join(tactics.TACTICS)}.")
  workload = models.make_workload(config.model, abstract=True)
  problem = Problem.build(trace_workload(workload), make_mesh(config.mesh, config.hardware))
  decisions = tactics.TACTICS[config.tactic](problem)
  result = cost_dict(problem.cost(decisions))
  result["decisions"] = [str(d) for d in decisions]
  result["baselines"] = baselines(problem)
  print(f"{workload.name} on {config.mesh} ({config.hardware}), tactic {config.tactic}: {len(decisions)} decisions")
  print(format_arguments(problem, decisions, config.max_args))
  print()
  print(format_costs({config.tactic: result, **result["baselines"]}))
  if config.json_path:
    with open(config.json_path, "w") as f:
      json.dump(result, f, indent=1)
  return result


def register(subparsers) -> None:
  parser = subparsers.add_parser("partition", help="a plan for a model and its cost beside the expert tactics")
  parser.add_argument("model", nargs="?", default="gpt")
  parser.add_argument("--mesh", default="data=2,model=4")
  parser.add_argument("--hardware", default="h100")
  parser.add_argument("--tactic", default="data_megatron", choices=sorted(tactics.TACTICS))
  parser.add_argument("--json", dest="json_path")
  parser.set_defaults(command=lambda a: run(PartitionConfig(a.model, a.mesh, a.hardware, a.tactic, a.json_path)))
