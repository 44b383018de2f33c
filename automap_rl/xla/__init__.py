"""Reading compiled XLA programs (collectives, flops, memory) and lowering plans to them."""

from automap_rl.xla.hlo import Collective
from automap_rl.xla.hlo import CompiledStats
from automap_rl.xla.hlo import axes_for_groups
from automap_rl.xla.hlo import inspect_compiled
from automap_rl.xla.hlo import summarize
from automap_rl.xla.lower import Lowered
from automap_rl.xla.numerics import NumericsError
from automap_rl.xla.numerics import check_numerics
from automap_rl.xla.lower import lower
from automap_rl.xla.realized import ShardingDifference

__all__ = [
    "Collective",
    "CompiledStats",
    "Lowered",
    "NumericsError",
    "ShardingDifference",
    "axes_for_groups",
    "check_numerics",
    "inspect_compiled",
    "lower",
    "summarize",
]
