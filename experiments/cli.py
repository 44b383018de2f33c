"""The `automap-rl` command: parses flags into typed configs and runs the launchers.

Only this module reads the command line; the library takes frozen dataclass configs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _virtual_devices(count: int = 8) -> None:
  """Gives jax `count` CPU devices unless the user set XLA_FLAGS; must run before jax imports."""
  flag = f"--xla_force_host_platform_device_count={count}"
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="automap-rl", description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)

  inspect = commands.add_parser("inspect", help="program size and named dimensions of a model")
  inspect.add_argument("model", nargs="?", default="gpt", help="zoo spec, e.g. gpt:layers=12,scan=true")
  inspect.add_argument("--seed", type=int, default=0)
  inspect.add_argument("--json", dest="json_path")
  inspect.add_argument("--rows", type=int, default=30, help="named dims to print")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  _virtual_devices()
  if args.command == "inspect":
    from experiments import inspect_cmd

    inspect_cmd.run(inspect_cmd.InspectConfig(args.model, args.seed, args.json_path, args.rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
