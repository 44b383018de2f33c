"""The `automap-rl` command: typed configs parsed by tyro, then the launchers.

Only this package reads the command line; the library takes frozen dataclass configs.
Each command is a frozen config dataclass and a `run(config)` function in its own module
(`COMMANDS`); tyro makes the command's flags, defaults and `--help` from the dataclass
and its docstring. Bad input ends with one line, `automap-rl CMD: error: ...`, and exit
status 2 (`--debug` shows the traceback instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from automap_rl import compilation_cache
from experiments.progress import phase


@dataclasses.dataclass(frozen=True)
class Command:
  """One sub-command: `module.config` parsed from the flags, then `module.run(config)`.

  Attributes:
    module: the module under `experiments` holding the config class and `run`.
    config: the config dataclass's name in that module.
    summary: one line for `automap-rl --help`.
    run: the function in that module that runs the config.
    devices: virtual CPU devices the command gets (8 for commands that lower plans onto
      devices, 64 for validation on 64-device meshes; the others run on one, as the
      simulator and the environments need no more, and virtual devices' runtimes share
      the host's cores).
    defaults: a function in that module that takes the flags and returns the config whose
      values are the flags' defaults (e.g. the one `--preset` names), or None for the
      class's own defaults.
  """

  module: str
  config: str
  summary: str
  run: str = "run"
  devices: int = 1
  defaults: str | None = None


COMMANDS: dict[str, Command] = {
  "inspect": Command(
    "inspect_cmd", "InspectConfig", "program size and named dimensions of a workload"
  ),
  "partition": Command(
    "partition_cmd",
    "PartitionConfig",
    "a plan for a workload (search or expert tactic) and its cost beside every expert",
    devices=8,
  ),
  "validate": Command(
    "validate_cmd",
    "ValidateConfig",
    "simulator vs XLA compiles: comm bytes, flops, memory, numerics, plan rankings",
    devices=64,
  ),
  "env": Command(
    "env_cmd", "EnvEpisodeConfig", "one random episode of the partitioning environment"
  ),
  "bench buckets": Command(
    "bench_buckets",
    "BucketBenchConfig",
    "how the task suite's problems share compiles (buckets, padding waste), and first calls",
  ),
  "bench simulator": Command(
    "bench_cmd", "SimulatorBenchConfig", "simulator evaluations per second", run="run_simulator"
  ),
  "bench env": Command(
    "bench_cmd", "EnvBenchConfig", "environment steps per second", run="run_env"
  ),
  "bench iopddl": Command(
    "iopddl_cmd",
    "IopddlBenchConfig",
    "the strategy-graph solver on the IOPDDL contest instances vs the best known costs",
    run="run_bench",
  ),
  "iopddl solve": Command(
    "iopddl_cmd",
    "SolveConfig",
    "solve an IOPDDL contest problem, write its solution",
    run="run_solve",
  ),
  "iopddl evaluate": Command(
    "iopddl_cmd",
    "CheckSolutionConfig",
    "check an IOPDDL solution as the contest does",
    run="run_evaluate",
  ),
  "bench pipeline": Command(
    "bench_pipeline",
    "PipelineBenchConfig",
    "pipelined expert and agent plans against intra-op plans on multi-node cases",
  ),
  "bench published": Command(
    "bench_published",
    "PublishedBenchConfig",
    "published training runs (papers' plans and measured TFLOP/s or MFU) against the simulator",
  ),
  "bench search": Command(
    "bench_search", "SearchBenchConfig", "search agents against the best expert tactic on the zoo"
  ),
  "suite list": Command(
    "suite_cmd",
    "SuiteListConfig",
    "the task suite's cases (workload, mesh, hardware, split)",
    run="run_list",
  ),
  "bench suite": Command(
    "suite_cmd",
    "SuiteBenchConfig",
    "experts, search agents and best-known plans on the task suite, and its difficulty",
    run="run_bench",
  ),
  "bench train": Command(
    "bench_train",
    "TrainBenchConfig",
    "training throughput (self-play samples/s, iterations/s) over devices and processes",
    devices=8,
  ),
  "bench step": Command(
    "bench_step",
    "StepBenchConfig",
    "measured training-step times on the local accelerator against the simulator's",
  ),
  "train": Command(
    "train_cmd",
    "TrainRunConfig",
    "train the policy/value network by Gumbel MuZero self-play on the task suite",
    defaults="preset_defaults",
  ),
  "evaluate": Command(
    "evaluate_cmd",
    "EvaluateConfig",
    "a trained policy with and without search against the baselines, per suite case",
  ),
}
DEBUG_FLAG = "--debug"
CACHE_FLAG = "--compilation-cache"


class CommandFailed(RuntimeError):
  """The command ran but its result is not what the user asked for (a plan that does not
  fit): one line on stderr and exit status 1, after its outputs are written."""


def virtual_devices(count: int = 8) -> None:
  """Gives jax `count` CPU devices unless the user set the flag; must run before jax imports."""
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
      f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    )


def write_json(path: str | None, document: Any) -> None:
  """Writes a command's figures to `path` (every command's `--json`), if one was given."""
  if path:
    with open(path, "w") as f:
      json.dump(document, f, indent=1)


OUTPUT_FIELDS = ("json", "plot")  # Config fields that name files a command writes.


def check_outputs(config: Any) -> None:
  """Fails before any work when a file the command would write cannot be written."""
  for field in OUTPUT_FIELDS:
    path = getattr(config, field, None)
    if path is None:
      continue
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
      raise ValueError(f"--{field} {path} is a directory; give a file path.")
    if not os.path.isdir(folder):
      raise ValueError(f"cannot write --{field} {path}: the directory {folder} does not exist.")
    if not os.access(folder, os.W_OK):
      raise ValueError(f"cannot write --{field} {path}: the directory {folder} is not writable.")


def usage() -> str:
  """`automap-rl --help`: the commands, the hardware profiles and the workload families."""
  from automap_rl import mesh, workloads

  width = max(len(name) for name in COMMANDS)
  lines = [
    "usage: automap-rl COMMAND [OPTIONS]   (automap-rl COMMAND --help lists every option and its "
    "default)",
    "",
    __doc__.splitlines()[0],
    "",
    "commands:",
  ]
  lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
  lines += [
    "",
    f"hardware profiles (--hardware): {', '.join(mesh.HARDWARE)}",
    f"workload families (WORKLOAD is FAMILY[:key=value,...]): {', '.join(workloads.FAMILIES)}; "
    f"external: {', '.join(workloads.EXTERNAL_FAMILIES)}",
    "meshes (--mesh): AXIS=SIZE or AXIS=DCNxICI,... e.g. data=16,model=8 or data=2x4,model=1x2"
    " (the plan says which link each axis uses)",
    f"{DEBUG_FLAG}: show Python tracebacks instead of one-line errors",
    cache_help(),
  ]
  return "\n".join(lines)


class UsageError(ValueError):
  """Flags that do not parse: the one-line message to print, for exit status 2."""


def cache_help() -> str:
  """The line of `--help` on the compilation cache: its flag, variable and directory."""
  return (
    f"{CACHE_FLAG} DIR|off: where compiled programs are kept between runs, or no cache "
    f"(also {compilation_cache.ENV}=DIR|0); now {compilation_cache.directory() or 'off'}"
  )


def take_option(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
  """The value of a global option (`FLAG VALUE` or `FLAG=VALUE`) anywhere in `argv`, and
  `argv` without it; `UsageError` when the value is missing."""
  rest, value = [], None
  words = iter(argv)
  for word in words:
    if word == flag:
      value = next(words, None)
      if value is None:
        raise UsageError(f"{flag} needs a directory or off")
    elif word.startswith(flag + "="):
      value = word[len(flag) + 1 :]
    else:
      rest.append(word)
  return value, rest


def _one_line(text: str) -> str:
  """The message of tyro's boxed parse error, on one line: the rows after its title, up
  to the argument's help text."""
  rows = [r.strip(" │╭╮╰╯─") for r in text.splitlines()]
  rows = [r for r in rows if r and not re.fullmatch(r"[-─ ]*", r)]
  message = []
  for row in rows[1:]:
    if row.startswith(("Argument helptext", "For full helptext")):
      break
    message.append(row)
  return re.sub(r"\s+", " ", " ".join(message or rows[:1])).strip()


def parse(name: str, argv: Sequence[str]):
  """The config of command `name` from its flags; `UsageError` with a one-line message."""
  import tyro

  command = COMMANDS[name]
  module = importlib.import_module(f"experiments.{command.module}")
  cls = getattr(module, command.config)
  default = getattr(module, command.defaults)(argv) if command.defaults else None
  out = io.StringIO()
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      return tyro.cli(
        cls,
        args=list(argv),
        prog=f"automap-rl {name}",
        description=f"{command.summary}\n\n{cache_help()}",
        default=default,
      )
  except SystemExit as e:
    if e.code == 0:  # --help
      print(out.getvalue(), end="")
      raise
    raise UsageError(
      f"automap-rl {name}: error: {_one_line(out.getvalue())} (see automap-rl {name} --help)"
    ) from None


def _command_name(argv: Sequence[str]) -> str | None:
  """The longest command name that `argv` starts with."""
  for words in (2, 1):
    name = " ".join(argv[:words])
    if name in COMMANDS:
      return name
  return None


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  debug = DEBUG_FLAG in argv
  argv = [a for a in argv if a != DEBUG_FLAG]
  try:
    cache, argv = take_option(argv, CACHE_FLAG)
    compilation_cache.configure(cache)
  except ValueError as e:  # A flag without its value, a directory that cannot be made.
    print(f"automap-rl: error: {e} (see automap-rl --help)", file=sys.stderr)
    return 2
  name = _command_name(argv)
  if name is None:
    if not argv or argv[0] in ("-h", "--help"):
      print(usage())
      return 0
    group = [n.split()[1] for n in COMMANDS if n.split()[0] == argv[0] and " " in n]
    if group:
      problem = f"{argv[0]} needs one of: {', '.join(group)}"
    else:
      commands = ", ".join(dict.fromkeys(n.split()[0] for n in COMMANDS))
      problem = f"unknown command {argv[0]!r}; commands: {commands}"
    print(f"automap-rl: error: {problem} (see automap-rl --help)", file=sys.stderr)
    return 2
  if COMMANDS[name].devices > 1:
    virtual_devices(COMMANDS[name].devices)
  command = COMMANDS[name]
  try:
    helping = bool({"-h", "--help"} & set(argv))
    with phase(f"loading {name}", enabled=sys.stderr.isatty() and not helping, leave=False):
      config = parse(name, argv[len(name.split()) :])
  except UsageError as e:
    print(e, file=sys.stderr)
    return 2
  except SystemExit as e:  # --help
    return int(e.code or 0)
  run = getattr(importlib.import_module(f"experiments.{command.module}"), command.run)
  try:
    check_outputs(config)
    run(config)
  except (
    ValueError,
    OSError,
  ) as e:  # Bad input (a workload spec, a mesh, a path): the message names it.
    if debug:
      raise
    print(f"automap-rl {name}: error: {e}", file=sys.stderr)
    return 2
  except CommandFailed as e:
    if debug:
      raise
    print(f"automap-rl {name}: FAILED: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  # Through the package, so that the commands' modules and this one share their classes
  # (`CommandFailed`), rather than through this `__main__` copy.
  sys.exit(importlib.import_module("experiments.cli").main())
