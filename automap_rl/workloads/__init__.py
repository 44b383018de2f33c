"""Model zoo and task suite: full AdamW training steps at configurable sizes.

``make_workload("gpt:layers=4,scan=true")`` or, at a published size,
``make_workload("llama:size=8b,batch=16", abstract=True)`` returns a
:class:`Workload` whose ``step(params, opt_state, batch)`` computes the loss,
its gradient and an optax AdamW update (families with batch-norm statistics
take and return them too). Parameters and batches are random, built from the
seed. :func:`load_cases` reads the task suite (workload, mesh, hardware) by
split. :data:`EXTERNAL_FAMILIES` wrap models that ship inside other packages
(:mod:`automap_rl.workloads.external`); the suite's ``external`` split holds them.
"""

from automap_rl.workloads.spec import (
  EXTERNAL_FAMILIES,
  FAMILIES,
  SMALL,
  STYLES,
  canonical_spec,
  make_workload,
  parse_model_spec,
)
from automap_rl.workloads.suite import SPLITS, Case, load_cases
from automap_rl.workloads.training import Workload

__all__ = [
  "EXTERNAL_FAMILIES",
  "FAMILIES",
  "SMALL",
  "SPLITS",
  "STYLES",
  "Case",
  "Workload",
  "canonical_spec",
  "load_cases",
  "make_workload",
  "parse_model_spec",
]
