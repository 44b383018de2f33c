"""Several processes (hosts) in one run: `jax.distributed` set up from flags or the environment.

Every process runs the same command; together they form one jax runtime whose devices
(`jax.devices()`) are all processes' devices, over which training shards its episodes
(`agents.train.data_mesh`). Each value comes from its flag, else its environment variable,
else, with `auto`, from the cluster launcher as `jax.distributed.initialize()` finds it
(Slurm's srun, Open MPI's mpirun, Kubernetes, Cloud TPU). CPU devices of different
processes talk through gloo (jax's `jax_cpu_collectives_implementation`, set to gloo
unless the environment chose another).

A lost peer. A process that dies (killed, its host lost) leaves the others waiting in a
collective or a barrier. Every process of a run watches the others (`PeerWatch`): each
counts up a key of `jax.distributed`'s key-value store every second (or 1/20 of the
timeout), and one whose count has not moved for `peer_timeout` seconds (less the two
periods it takes to see it) is lost: the watcher prints one line naming it to stderr and
exits with status 1, whatever its main thread is blocked in. Process 0 serves the
coordination service; when it is lost, JAX's client in every other process sees the
service gone at once and aborts the process (C's `abort()`, after its own fatal log; it
gives Python no other hook). The watch catches that abort with a C-level SIGABRT handler:
if the coordinator no longer takes connections, it prints the same one line naming
process 0 and exits with status 1; any other abort goes on. JAX's own heartbeat (a process
that has sent none for twice `peer_timeout` is dead) is the backstop; it ends the process
without a Python-visible error, so the watch, which reports first, is what the user sees.
Restarting every process with the same run directory resumes from the last checkpoint.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import jax
from jax._src import distributed as jax_distributed  # Its client, as orbax reads it too.

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
    peer_timeout: seconds without a sign of life after which a process is lost; the
      others then exit with an error naming it (`PeerWatch`).
  """

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  auto: bool = False
  peer_timeout: float = 60.0


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
  if config.peer_timeout <= 0:
    raise ValueError(f"--distributed.peer-timeout {config.peer_timeout}: give a positive number.")
  if CPU_COLLECTIVES_ENV not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=address,
    num_processes=count,
    process_id=index,
    cluster_detection_method=None if config.auto else "deactivate",
    heartbeat_timeout_seconds=int(2 * config.peer_timeout) + 1,
  )
  PeerWatch(config.peer_timeout).start()


ALIVE_KEY = "automap_rl/alive"  # ALIVE_KEY/<process>: its count of seconds alive, or DONE.
DONE = "done"
_ABORT_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)


def on_abort(callback: Callable[[], None]) -> Callable[[int], None]:
  """Installs a C-level SIGABRT handler that calls `callback` in the thread that aborts,
  before the abort goes on (the process ends by SIGABRT when `callback` returns). Python's
  `signal.signal` cannot do it: its handlers run later, in the main thread, and `abort()`
  ends the process first. Returns the handler, which must be kept alive."""
  libc = ctypes.CDLL(None)
  libc.signal.restype = ctypes.c_void_p
  libc.signal.argtypes = [ctypes.c_int, _ABORT_HANDLER]
  handler = _ABORT_HANDLER(lambda signum: callback())
  libc.signal(signal.SIGABRT, handler)
  return handler


def reachable(address: str, timeout: float) -> bool:
  """Whether `address` (host:port, the host maybe in brackets) takes a TCP connection
  within `timeout` seconds."""
  host, port = address.rsplit(":", 1)
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
  except OSError:
    return False
  return True


class PeerWatch(threading.Thread):
  """Watches the other processes of the run (see the module docstring); a daemon thread,
  one per process, started by `initialize`. `finish` tells the others this process ended
  on purpose."""

  current: PeerWatch | None = None

  def __init__(self, timeout: float):
    super().__init__(name="peer-watch", daemon=True)
    self.timeout = timeout
    self.client = jax_distributed.global_state.client
    self.coordinator = jax_distributed.global_state.coordinator_address
    self.me, self.count = jax.process_index(), jax.process_count()
    self.stopped = threading.Event()
    self.abort_handler = None if self.me == 0 else on_abort(self.aborted)
    PeerWatch.current = self

  def run(self) -> None:
    seen = {p: (None, time.monotonic()) for p in range(self.count) if p != self.me}
    beats, period = 0, min(1.0, self.timeout / 20)
    while not self.stopped.wait(period):
      beats += 1
      try:
        self.client.key_value_set(f"{ALIVE_KEY}/{self.me}", str(beats), allow_overwrite=True)
      except Exception:  # The coordination service (process 0) is gone: it stops counting.
        pass
      now = time.monotonic()
      for p, (last, since) in list(seen.items()):
        try:
          value = self.client.key_value_try_get(f"{ALIVE_KEY}/{p}")
        except Exception:  # Not written yet, or the service is gone.
          value = last
        if value == DONE:
          del seen[p]
        elif value != last:
          seen[p] = (value, now)
        elif now - since > self.timeout - 2 * period and not self.stopped.is_set():
          self.lost(p, f"no sign of life for {self.timeout:g} s")

  def aborted(self) -> None:
    """This process aborts (C's SIGABRT): when the coordinator (process 0) takes no
    connection, JAX's client lost its service, and process 0 is reported lost; else the
    abort goes on."""
    if not self.stopped.is_set() and not reachable(self.coordinator, min(5.0, self.timeout)):
      self.lost(0, f"its coordination service at {self.coordinator} is gone")

  def lost(self, process: int, why: str) -> None:
    """Reports `process` lost (`why`: the evidence) on stderr and ends this one with
    status 1 (a direct write: the caller may be a signal handler)."""
    what = " (the coordinator)" if process == 0 else ""
    line = (
      f"automap-rl: error: lost process {process}{what} of {self.count}: {why}; "
      "restart every process with the same run directory to resume\n"
    )
    os.write(2, line.encode())
    os._exit(1)

  def finish(self) -> None:
    """Stops watching and tells the others that this process ends on purpose."""
    self.stopped.set()
    try:
      self.client.key_value_set(f"{ALIVE_KEY}/{self.me}", DONE, allow_overwrite=True)
    except Exception:
      pass


def finish() -> None:
  """Tells the run's other processes that this one ends on purpose (no-op with one)."""
  if PeerWatch.current is not None:
    PeerWatch.current.finish()


def await_lost_peer(error: Exception) -> None:
  """After a collective failed with `error` in a multi-process run: waits for the watch
  to name the lost process (it ends this one), up to its timeout; then returns, and the
  caller re-raises `error`."""
  if PeerWatch.current is not None and not PeerWatch.current.stopped.is_set():
    PeerWatch.current.stopped.wait(PeerWatch.current.timeout + 5.0)
