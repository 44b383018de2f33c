"""Compiling in a child process, so that an XLA abort cannot kill the caller.

XLA's SPMD partitioner checks its invariants with `CHECK`s: a sharding it cannot partition
(a grouped convolution split across a group, for one) aborts the whole process (SIGABRT),
and with it the user's session. `compile_directly` compiles the module of a
`jax.stages.Lowered` (its StableHLO text, which carries the plan's shardings) in a fresh
Python process with the same platform, device count and partitioner, through
`jax.extend.backend`. A compile that dies there raises `CompileAborted` with XLA's own
message; one that succeeds means the caller's compile of the same module will too.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import jax
import numpy as np

from automap_rl.compile_options import quick_compile_options

__all__ = ["CompileAborted", "backend_compile", "compile_directly"]


def backend_compile(text: str, platform: str, shardy: bool, ids: list[int], dump_to: str = "",
                    debug_options: dict[str, Any] | None = None) -> None:
  """Compiles the StableHLO `text` with SPMD partitioning over the devices `ids` (in mesh
  order) through the backend itself (`jax.extend.backend`, not jax's persistent
  compilation cache, whose hits run no pass), with the XLA `debug_options`; with
  `dump_to`, XLA writes the module entering its SPMD partitioner there. Self-contained:
  the child process runs its source."""
  import jax
  import jax.extend.backend as backend
  import numpy as np

  by_id = {d.id: d for d in jax.devices(platform)}
  options = backend.get_compile_options(num_replicas=1, num_partitions=len(ids),
                                        device_assignment=np.array(ids).reshape(1, len(ids)))
  build = options.executable_build_options
  build.use_spmd_partitioning = True
  build.use_shardy_partitioner = shardy
  for name, value in (debug_options or {}).items():
    setattr(build.debug_options, name, value)
  if dump_to:
    build.debug_options.xla_dump_to = dump_to
    build.debug_options.xla_dump_hlo_pass_re = "spmd-partitioning"
  backend.get_backend(platform).compile_and_load(text, [by_id[i] for i in ids], options)


# The child: reads the module from stdin and compiles it (`backend_compile`; argv: platform,
# shardy, dump directory, options as JSON, device ids), exits 0; an XLA CHECK aborts it.
_CHILD = "from __future__ import annotations\n" + inspect.getsource(backend_compile) + """
import json, sys
backend_compile(sys.stdin.read(), sys.argv[1], sys.argv[2] == "1", [int(i) for i in sys.argv[5:]], sys.argv[3],
                json.loads(sys.argv[4]))
"""

# glog's fatal line: `F1123 13:56:07.484964   20148 convolution_handler.cc:984] Check failed: ...`.
_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ ([\w.]+:\d+)\] (.*)$")


class CompileAborted(RuntimeError):
  """XLA aborted (or timed out) compiling a module in the child process.

  Attributes:
    where: XLA's source location of the failed check (`convolution_handler.cc:984`), or ''.
    message: XLA's message (`Check failed: ...`), or the child's last words.
  """

  def __init__(self, where: str, message: str):
    super().__init__(f"{where}: {message}" if where else message)
    self.where = where
    self.message = message


def _child_env(num_devices: int, platform: str) -> dict[str, str]:
  """The caller's environment with at least `num_devices` host devices on CPU."""
  env = dict(os.environ)
  if platform == "cpu":
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(num_devices, jax.device_count())}".strip()
  env["JAX_PLATFORMS"] = platform
  return env


def compile_directly(stage: Any, devices: np.ndarray, isolated: bool = True, dump_to: str = "",
                     timeout_s: float = 600.0) -> None:
  """Compiles `stage` (a `jax.stages.Lowered`) over `devices` (the mesh's devices, in mesh
  order) with `backend_compile` and `quick_compile_options`: in a child process when `isolated`, raising
  `CompileAborted` if XLA aborts the child (a fatal check or a signal) or it times out (a
  compile that raises an ordinary error there is left to the caller's own compile to
  raise); in this process otherwise (XLA's errors raise here). `dump_to`: see
  `backend_compile`.

  Isolated, it costs a Python start and an import of jax (about two seconds) plus one compile.
  """
  flat = list(np.asarray(devices).flat)
  platform = flat[0].platform
  shardy = bool(jax.config.jax_use_shardy_partitioner)
  ids = [d.id for d in flat]
  options = quick_compile_options(platform)
  if not isolated:
    backend_compile(stage.as_text(debug_info=True), platform, shardy, ids, dump_to, options)
    return
  command = [sys.executable, "-c", _CHILD, platform, "1" if shardy else "0", dump_to, json.dumps(options),
             *map(str, ids)]
  try:
    done = subprocess.run(command, input=stage.as_text(debug_info=True), capture_output=True, text=True, timeout=timeout_s,
                          env=_child_env(len(flat), platform))
  except subprocess.TimeoutExpired:
    raise CompileAborted("", f"the compile did not finish in {timeout_s:.0f}s") from None
  lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
  for line in lines:
    match = _FATAL.match(line)
    if match:
      raise CompileAborted(match.group(1), match.group(2))
  if done.returncode < 0:
    raise CompileAborted("", f"the compile was killed by {signal.Signals(-done.returncode).name}: "
                             f"{lines[-1] if lines else 'no message'}")
  # Exit 0, or a Python exception: the caller's own compile succeeds or raises it.
