"""The layers contract: automap_rl (core) <- envs <- agents <- experiments, enforced by
import-linter, and no JAX internals."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("automap_rl", "envs", "agents", "experiments")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint(root: Path) -> subprocess.CompletedProcess:
  return subprocess.run(
    [str(LINT_IMPORTS), "--no-cache"],
    cwd=root,
    capture_output=True,
    text=True,
    env={"PYTHONPATH": str(root), "PATH": ""},
    timeout=120,
  )


def copy_tree(tmp_path: Path) -> Path:
  for package in PACKAGES:
    shutil.copytree(
      ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
    )
  shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
  return tmp_path


def test_the_repository_keeps_its_layers():
  result = lint(ROOT)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
  "module,source",
  [
    ("envs/upward.py", "from experiments import cli\n"),
    (
      "automap_rl/upward.py",
      "def later():\n  import agents  # A lazy import still counts.\n  return agents\n",
    ),
  ],
)
def test_a_lower_layer_importing_a_higher_one_breaks_the_contract(tmp_path, module, source):
  root = copy_tree(tmp_path)
  (root / module).write_text(source)
  result = lint(root)
  assert result.returncode != 0
  assert "BROKEN" in result.stdout and module.replace("/", ".").removesuffix(".py") in result.stdout


# The one private module the project reads: the coordination service's key-value store,
# which `jax.distributed` starts but exposes no public handle to (orbax reads it the same
# way); the lost-peer watch of multi-process training counts in it.
JAX_INTERNALS_READ = {"experiments/distributed.py": "from jax._src import distributed"}


def test_no_jax_internals():
  hits = [
    f"{path.relative_to(ROOT)}:{n}"
    for package in PACKAGES
    for path in (ROOT / package).rglob("*.py")
    for n, line in enumerate(path.read_text().splitlines(), 1)
    if "jax._src" in line
    and not line.startswith(JAX_INTERNALS_READ.get(str(path.relative_to(ROOT)), "\0"))
  ]
  assert hits == []
