"""Model zoo: full AdamW training steps at configurable sizes.

``make_workload("gpt:layers=4,scan=true")`` returns a :class:`Workload` whose
``step(params, opt_state, batch)`` computes the loss, its gradient and an
optax AdamW update. Parameters and batches are random, built from the seed.
"""

from automap_rl.workloads.spec import FAMILIES, make_workload, parse_model_spec
from automap_rl.workloads.training import Workload

__all__ = ["FAMILIES", "Workload", "make_workload", "parse_model_spec"]
