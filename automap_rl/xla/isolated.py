"""Compiling in a child process, so that an XLA abort cannot kill the caller.

XLA's SPMD partitioner checks its invariants with `CHECK`s: a sharding it cannot partition
(a grouped convolution split across a group, for one) aborts the whole process (SIGABRT),
and with it the user's session. `compile_directly` compiles the module of a
`jax.stages.Lowered` (its StableHLO text, which carries the plan's shardings) in a child
Python process with the same platform, device count and partitioner, through
`jax.extend.backend`. A compile that dies there raises `CompileAborted` with XLA's own
message; one that succeeds means the caller's compile of the same module will too.

The child stays up between compiles (a Python start and an import of jax cost about two
seconds; a small model's plan compiles in one to three): it reads modules from its stdin
and answers a line for each. One that dies is replaced at the next compile. Asked for
them, it hands back the compiled module's analyses (`CompiledModule`: its text, cost and
memory analyses), so that a caller who only inspects the module compiles it once.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import types
from typing import Any

import jax
import numpy as np

from automap_rl.compile_options import quick_compile_options

__all__ = ["CompileAborted", "CompiledModule", "backend_compile", "compile_directly"]


def backend_compile(
  text: str,
  platform: str,
  shardy: bool,
  ids: list[int],
  dump_to: str = "",
  options: dict[str, Any] | None = None,
  analyses_to: str = "",
) -> None:
  """Compiles the StableHLO `text` with SPMD partitioning over the devices `ids` (in mesh
  order) through the backend itself (`jax.extend.backend`, not jax's persistent
  compilation cache, whose hits run no pass), with the XLA `options` (as `jax.jit`'s
  `compiler_options` pass them); with `dump_to`, XLA writes the module entering its SPMD
  partitioner there; with `analyses_to`, the compiled module's text, cost analysis and
  memory sizes go to that file as JSON (`CompiledModule`). Self-contained: the child
  process runs its source."""
  import json

  import jax
  import jax.extend.backend as backend
  import numpy as np

  by_id = {d.id: d for d in jax.devices(platform)}
  options = backend.get_compile_options(
    num_replicas=1,
    num_partitions=len(ids),
    device_assignment=np.array(ids).reshape(1, len(ids)),
    env_options_overrides=options,
  )
  build = options.executable_build_options
  build.use_spmd_partitioning = True
  build.use_shardy_partitioner = shardy
  if dump_to:
    build.debug_options.xla_dump_to = dump_to
    build.debug_options.xla_dump_hlo_pass_re = "spmd-partitioning"
  executable = backend.get_backend(platform).compile_and_load(
    text, [by_id[i] for i in ids], options
  )
  if analyses_to:
    memory = executable.get_compiled_memory_stats()
    sizes = ("argument", "output", "temp", "alias")
    analyses = {
      "text": "\n\n".join(m.to_string() for m in executable.hlo_modules()),
      "cost": executable.cost_analysis(),
      "memory": {f"{k}_size_in_bytes": int(getattr(memory, f"{k}_size_in_bytes")) for k in sizes},
    }
    with open(analyses_to, "w") as f:
      json.dump(analyses, f)


@dataclasses.dataclass(frozen=True)
class CompiledModule:
  """What a compile in `compile_directly` hands back of the compiled module: the analyses
  of a `jax.stages.Compiled` that `hlo.inspect_compiled` reads, without an executable.

  Attributes:
    text: the compiled (partitioned, optimized) module's HLO text.
    cost: XLA's cost analysis (`flops`, `bytes accessed`, ...).
    memory: `argument_size_in_bytes`, `output_size_in_bytes`, `temp_size_in_bytes` and
      `alias_size_in_bytes` of its buffer assignment.
  """

  text: str
  cost: dict[str, float]
  memory: dict[str, int]

  def as_text(self) -> str:
    return self.text

  def cost_analysis(self) -> dict[str, float]:
    return self.cost

  def memory_analysis(self) -> types.SimpleNamespace:
    return types.SimpleNamespace(**self.memory)


# The child: for each request on stdin (a JSON header line with `backend_compile`'s
# arguments, the module's size in bytes and a log file, then the module's text), sends its
# stderr to the log file, compiles (`backend_compile`) and answers `ok` or `error` (an
# ordinary XLA error, left to the caller's own compile to raise, or written to the
# analyses file where the request names one) on stdout; an XLA CHECK aborts it. It exits
# when the caller closes its stdin.
_CHILD = (
  "from __future__ import annotations\n"
  + inspect.getsource(backend_compile)
  + """
import json, os, sys
requests, replies = sys.stdin.buffer, sys.stdout.buffer
for header in requests:
  request = json.loads(header)
  text = requests.read(request["size"]).decode()
  log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  os.dup2(log, 2)
  os.close(log)
  try:
    backend_compile(text, request["platform"], request["shardy"], request["ids"],
                    request["dump_to"], request["options"], request["analyses_to"])
    replies.write(b"ok\\n")
  except Exception as error:
    if request["analyses_to"]:
      with open(request["analyses_to"], "w") as f:
        json.dump({"error": str(error)}, f)
    replies.write(b"error\\n")
  replies.flush()
"""
)

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
    env["XLA_FLAGS"] = (
      f"{flags} --xla_force_host_platform_device_count={max(num_devices, jax.device_count())}"
    ).strip()
  env["JAX_PLATFORMS"] = platform
  return env


class _Child:
  """A compiling child process (see `_CHILD`) with the environment `env`."""

  def __init__(self, env: dict[str, str]):
    self.timed_out: float | None = None
    handle, self.log = tempfile.mkstemp(prefix="automap_compile_", suffix=".log")
    with os.fdopen(handle, "w") as log:  # Until its first request: what an import of jax says.
      self.process = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        env=env,
      )

  def close(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait()
    for pipe in (self.process.stdin, self.process.stdout):
      pipe.close()
    os.unlink(self.log)

  def compile(self, text: str, request: dict[str, Any], timeout_s: float) -> bool:
    """Sends one module; True when the child answered (compiled, or raised an ordinary
    error), False when it died or timed out (then `aborted()` says why)."""
    data = text.encode()
    header = json.dumps({**request, "size": len(data), "log": self.log}).encode() + b"\n"
    try:
      self.process.stdin.write(header + data)
      self.process.stdin.flush()
    except BrokenPipeError:
      return False
    ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
    if not ready:
      self.process.kill()
      self.timed_out = timeout_s
      return False
    return bool(self.process.stdout.readline())

  def aborted(self) -> CompileAborted:
    """Why the child died: XLA's fatal check, the signal that killed it, or the timeout."""
    code = self.process.wait()
    if self.timed_out is not None:
      return CompileAborted("", f"the compile did not finish in {self.timed_out:.0f}s")
    with open(self.log, errors="replace") as f:
      lines = [line.strip() for line in f if line.strip()]
    for line in lines:
      match = _FATAL.match(line)
      if match:
        return CompileAborted(match.group(1), match.group(2))
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"ended with exit code {code}"
    return CompileAborted("", f"the compile was {how}: {lines[-1] if lines else 'no message'}")


_CHILDREN: dict[tuple[tuple[str, str], ...], _Child] = {}  # By environment; at most one lives.


def _close_children() -> None:
  while _CHILDREN:
    _CHILDREN.popitem()[1].close()


atexit.register(_close_children)


def _compile_in_child(
  text: str, request: dict[str, Any], env: dict[str, str], timeout_s: float
) -> None:
  key = tuple(sorted(env.items()))
  if key not in _CHILDREN:
    _close_children()
    _CHILDREN[key] = _Child(env)
  child = _CHILDREN[key]
  if not child.compile(text, request, timeout_s):
    del _CHILDREN[key]
    error = child.aborted()
    child.close()
    raise error


def compile_directly(
  stage: Any,
  devices: np.ndarray,
  isolated: bool = True,
  dump_to: str = "",
  timeout_s: float = 600.0,
  analyses: bool = False,
) -> CompiledModule | None:
  """Compiles `stage` (a `jax.stages.Lowered`) over `devices` (the mesh's devices, in mesh
  order) with `backend_compile` and `quick_compile_options`: in a child process when
  `isolated`, raising `CompileAborted` if XLA aborts the child (a fatal check or a signal)
  or it times out (a compile that raises an ordinary error there is left to the caller's
  own compile to raise, except with `analyses`, where it raises here as
  `jax.errors.JaxRuntimeError`); in this process otherwise (XLA's errors raise here). `dump_to`: see
  `backend_compile`. With `analyses`, returns the compiled module's `CompiledModule`, the
  same module `stage.compile(compiler_options=quick_compile_options(...))` makes; None
  otherwise.

  Isolated, it costs one compile in the child, which stays up for the next (its first
  compile also starts it: a Python start and an import of jax, about two seconds).
  """
  flat = list(np.asarray(devices).flat)
  platform = flat[0].platform
  shardy = bool(jax.config.jax_use_shardy_partitioner)
  ids = [d.id for d in flat]
  options = quick_compile_options(platform)
  text = stage.as_text(debug_info=True)
  with tempfile.TemporaryDirectory(prefix="automap_analyses_") as folder:
    analyses_to = os.path.join(folder, "analyses.json") if analyses else ""
    if not isolated:
      backend_compile(text, platform, shardy, ids, dump_to, options, analyses_to)
    else:
      request = {
        "platform": platform,
        "shardy": shardy,
        "ids": ids,
        "dump_to": dump_to,
        "options": options,
        "analyses_to": analyses_to,
      }
      _compile_in_child(text, request, _child_env(len(flat), platform), timeout_s)
    if not analyses:
      return None
    with open(analyses_to) as f:
      found = json.load(f)
  if "error" in found:
    raise jax.errors.JaxRuntimeError(found["error"])
  return CompiledModule(**found)
