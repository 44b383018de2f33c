"""Reading compiled XLA programs: collectives, flops and memory."""

from automap_rl.xla.hlo import Collective
from automap_rl.xla.hlo import CompiledStats
from automap_rl.xla.hlo import axes_for_groups
from automap_rl.xla.hlo import inspect_compiled
from automap_rl.xla.hlo import summarize

__all__ = [
    "Collective",
    "CompiledStats",
    "axes_for_groups",
    "inspect_compiled",
    "summarize",
]
