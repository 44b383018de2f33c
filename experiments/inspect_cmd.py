"""`automap-rl inspect WORKLOAD`: the program size and named dimensions of a workload."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from automap_rl import ir, workloads
from experiments.cli import write_json
from experiments.options import JsonPath, PositionalWorkload


@dataclasses.dataclass(frozen=True)
class InspectConfig:
  """What to inspect.

  Attributes:
    workload: the workload spec, e.g. `gpt:layers=12,scan=true`.
    seed: seed of the example arguments.
    json: where to write the JSON summary.
    rows: how many named dims to print (the largest by member count first).
  """

  workload: PositionalWorkload = "gpt"
  seed: int = 0
  json: JsonPath = None
  rows: int = 30


def summarize(program: ir.Program, named: ir.NamedDims) -> dict[str, Any]:
  """The JSON summary: program size, named dims, groups and conflicts."""
  return {
    "num_ops": program.num_ops,
    "num_values": program.num_values,
    "unknown_primitives": list(program.unknown_primitives),
    "named_dims": [
      {
        "id": c.id,
        "size": c.size,
        "num_members": c.num_members,
        "group": c.group,
        "examples": list(c.examples),
      }
      for c in named.classes
    ],
    "groups": [{"id": g, "num_classes": len(members)} for g, members in enumerate(named.groups)],
    "conflicts": [dataclasses.asdict(c) for c in named.conflicts],
  }


def render(summary: dict[str, Any], max_rows: int) -> str:
  """A table a person can read."""
  group_sizes = {g["id"]: g["num_classes"] for g in summary["groups"]}
  conflicted = {c["class_id"] for c in summary["conflicts"]}
  lines = [
    f"ops {summary['num_ops']}  values {summary['num_values']}  "
    f"named dims {len(summary['named_dims'])}  groups {len(summary['groups'])}  "
    f"unknown primitives {summary['unknown_primitives'] or 'none'}",
    f"{'dim':>5} {'size':>7} {'members':>8} {'group':>9}  examples",
  ]
  rows = sorted(summary["named_dims"], key=lambda d: -d["num_members"])[:max_rows]
  for d in rows:
    group = f"{d['group']}(x{group_sizes[d['group']]})"
    flag = " [conflict]" if d["id"] in conflicted else ""
    lines.append(
      f"{d['id']:>5} {d['size']:>7} {d['num_members']:>8} {group:>9}  "
      f"{', '.join(d['examples'])}{flag}"
    )
  if len(summary["named_dims"]) > max_rows:
    lines.append(f"... {len(summary['named_dims']) - max_rows} more named dims (see --json)")
  for c in summary["conflicts"]:
    lines.append(
      f"conflict: dim {c['class_id']} twice in one {c['kind']} ({c['count']}x), e.g. {c['example']}"
    )
  return "\n".join(lines)


def run(config: InspectConfig) -> dict[str, Any]:
  start = time.perf_counter()
  workload = workloads.make_workload(config.workload, seed=config.seed, abstract=True)
  program = workload.trace()
  summary = summarize(program, ir.analyze(program))
  summary["seconds"] = round(time.perf_counter() - start, 3)
  print(f"{workload.name}: traced and analysed in {summary['seconds']:.2f}s")
  print(render(summary, config.rows))
  write_json(config.json, summary)
  return summary
