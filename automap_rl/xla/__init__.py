"""Reading compiled XLA programs (collectives, flops, memory) and lowering plans to them."""

from automap_rl.xla.hlo import (
  Collective,
  CompiledStats,
  axes_for_groups,
  inspect_compiled,
  summarize,
)
from automap_rl.xla.lower import Lowered, lower
from automap_rl.xla.numerics import NumericsError, check_numerics
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
