"""Fused kernels: named scopes whose ops an accelerator's compiler runs as one kernel.

A step marks the ops of such a kernel with `jax.named_scope(name)`, `name` one of
`FUSED_KERNELS`; `ir.trace` records the innermost one on each op (`Op.kernel`). On a
backend that runs them fused (`Hardware.fused_kernels`), the values a kernel makes and
only it reads stay on chip: they move no HBM bytes and take no memory
(`simulator.fusion.kernel_intermediates`). Elsewhere (XLA:CPU) the ops run as written.

* `FUSED_ATTENTION_FORWARD`, `FUSED_ATTENTION_BACKWARD`: flash attention's forward (scores,
  softmax and the weighted sum of values per query block, keeping the log-sum-exp) and its
  backward (the scores recomputed from the queries, keys and log-sum-exp), as cuDNN's
  fused attention runs on GPUs and Pallas' flash attention on TPUs
  (`workloads.attention.fused_causal_attention`).
"""

from __future__ import annotations

import re

FUSED_ATTENTION_FORWARD = "fused_attention_forward"
FUSED_ATTENTION_BACKWARD = "fused_attention_backward"
FUSED_KERNELS = (FUSED_ATTENTION_FORWARD, FUSED_ATTENTION_BACKWARD)

_KERNEL_NAME = re.compile(r"\b(" + "|".join(FUSED_KERNELS) + r")\b")


def kernel_of(name_stack: str) -> str:
  """The innermost fused kernel a name stack (`a/b(c)/d`, transforms as `jvp(...)`) names,
  or '' for none."""
  found = _KERNEL_NAME.findall(name_stack)
  return found[-1] if found else ""
