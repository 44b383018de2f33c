"""The hardware the tests' toy models are priced on.

A toy model's step takes well under a millisecond, and a GPU's per-kernel overhead
(`Hardware.kernel_overhead_s`) would set its pace whatever the plan. Tests of the search,
the environment and the stages price the work alone: the `h100` profile without it.
"""

import dataclasses

from automap_rl.mesh import get_hardware

H100_WORK_ONLY = dataclasses.replace(get_hardware("h100"), kernel_overhead_s=0.0)
