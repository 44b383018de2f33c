"""Typed command-line options shared by the commands' configs (tyro reads the annotations).

Hardware profiles and workload families are listed from the library's registries, so
`--help` names every valid value.
"""

from __future__ import annotations

from typing import Annotated, Literal

import tyro

from agents.registry import AGENTS
from automap_rl import mesh, tactics, workloads

Hardware = Literal[tuple(mesh.HARDWARE)]  # type: ignore[valid-type]
Tactic = Literal[(*tactics.TACTICS, *tactics.PIPELINE_TACTICS)]  # type: ignore[valid-type]
AgentName = Literal[tuple(AGENTS)]  # type: ignore[valid-type]
WORKLOAD_HELP = (
  "FAMILY[:key=value,...], e.g. gpt:layers=8,d_model=1024; families: "
  f"{', '.join(workloads.FAMILIES)}; "
  f"external: {', '.join(workloads.EXTERNAL_FAMILIES)}"
)
Workload = Annotated[str, tyro.conf.arg(metavar="WORKLOAD", help=WORKLOAD_HELP)]
PositionalWorkload = Annotated[
  str, tyro.conf.Positional, tyro.conf.arg(metavar="WORKLOAD", help=WORKLOAD_HELP)
]
OptionalWorkload = Annotated[str | None, tyro.conf.arg(metavar="WORKLOAD", help=WORKLOAD_HELP)]
MeshSpec = Annotated[
  str,
  tyro.conf.arg(
    metavar="AXIS=SIZE,...",
    help=(
      "mesh axes, major to minor, e.g. data=16,model=8: each axis's split into devices inside "
      "a node (ICI: NVLink, a TPU pod's torus) and nodes (DCN: the network) is inferred, the "
      "minor axes filling a node first; AXIS=DCNxICI states it, e.g. data=2x4,model=1x2 "
      "(then an axis without one is all ICI, as create_hybrid_device_mesh); the plan says "
      "which link each axis uses"
    ),
  ),
]
JsonPath = Annotated[
  str | None, tyro.conf.arg(metavar="PATH", help="write the figures as JSON here")
]
PlotPath = Annotated[str | None, tyro.conf.arg(metavar="PATH", help="draw a PNG here")]
