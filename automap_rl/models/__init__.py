"""Model zoo: full AdamW training steps at configurable sizes.

``make_workload("gpt:layers=4,scan=true")`` returns a :class:`Workload` whose
``step(params, opt_state, batch)`` computes the loss, its gradient and an
optax AdamW update. Parameters and batches are random, built from the seed.
"""

from automap_rl.models.spec import MODEL_NAMES, make_workload, parse_model_spec
from automap_rl.models.training import Workload

__all__ = ["MODEL_NAMES", "Workload", "make_workload", "parse_model_spec"]
