"""Several processes (hosts) in one run: `jax.distributed` set up from flags or the environment.

Every process runs the same command; together they form one jax runtime whose devices
(`jax.devices()`) are all processes' devices, over which training shards its episodes
(`agents.train.data_mesh`). Each value comes from its flag, else its environment variable,
else, with `auto`, from the cluster launcher as `jax.distributed.initialize()` finds it
(Slurm's srun, Open MPI's mpirun, Kubernetes, Cloud TPU). CPU devices of different
processes talk through gloo (jax's `jax_cpu_collectives_implementation`, set to gloo
unless the environment chose another).
"""

from __future__ import annotations

import dataclasses
import os

import jax

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # Read by jax itself as well.
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
CPU_COLLECTIVES_ENV = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins a multi-process run (leave all unset for one process).

  Attributes:
    coordinator_address: host:port of the coordinator, which process 0 serves and every
      process reaches (default `$JAX_COORDINATOR_ADDRESS`).
    num_processes: how many processes the run has (default `$JAX_NUM_PROCESSES`).
    process_id: this process's index, 0 to num_processes - 1 (default `$JAX_PROCESS_ID`).
    auto: take what is not given from the cluster launcher (Slurm, Open MPI, Kubernetes,
      Cloud TPU), as `jax.distributed.initialize()` does.
  """

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  auto: bool = False


def _env_int(name: str) -> int | None:
  text = os.environ.get(name)
  if text is None or text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"${name}={text!r} is no integer.") from None


def initialize(config: DistributedConfig) -> None:
  """Joins the multi-process run `config` and the environment describe (nothing when
  neither names one, or when this process has joined one already). Call before jax
  touches a device.

  Raises:
    ValueError: a value is missing or malformed.
  """
  address = config.coordinator_address or os.environ.get(COORDINATOR_ENV) or None
  count = config.num_processes if config.num_processes is not None else _env_int(NUM_PROCESSES_ENV)
  index = config.process_id if config.process_id is not None else _env_int(PROCESS_ID_ENV)
  if jax.distributed.is_initialized():
    return
  given = {"coordinator-address": address, "num-processes": count, "process-id": index}
  if not config.auto:
    if all(v is None for v in given.values()):
      return
    missing = [f"--distributed.{name}" for name, value in given.items() if value is None]
    if missing:
      raise ValueError(
        f"a multi-process run needs {' and '.join(missing)} as well (or ${COORDINATOR_ENV}, "
        f"${NUM_PROCESSES_ENV}, ${PROCESS_ID_ENV}; or --distributed.auto under a cluster launcher)."
      )
  if CPU_COLLECTIVES_ENV not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=address,
    num_processes=count,
    process_id=index,
    cluster_detection_method=None if config.auto else "deactivate",
  )
