"""The persistent compilation cache: on by default where `--help` says, off on request."""

import os
import subprocess
import sys

import pytest

from automap_rl import compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs `automap-rl --help` with the given flags, then compiles a function; prints the
# directory JAX's config names and the number of files in it.
SCRIPT = """
import sys
from experiments import cli
assert cli.main(sys.argv[1:] + ["--help"]) == 0
import os, jax, jax.numpy as jnp
jax.jit(lambda x: jnp.sin(x) @ x)(jnp.ones((8, 8))).block_until_ready()
path = jax.config.jax_compilation_cache_dir
print("CACHE", path, len(os.listdir(path)) if path else 0)
"""


def run_cli(tmp_path, flags, **env_vars):
  """The output of `SCRIPT` with `XDG_CACHE_HOME` in `tmp_path` and `env_vars` set."""
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in (compilation_cache.ENV, "JAX_COMPILATION_CACHE_DIR")
  }
  env.update(XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=ROOT, **env_vars)
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  done = subprocess.run(
    [sys.executable, "-c", SCRIPT, *flags], env=env, capture_output=True, text=True, check=True
  )
  return done.stdout


def test_commands_keep_compiles_in_the_user_cache_directory_that_help_names(tmp_path):
  out = run_cli(tmp_path, [])
  stated = os.path.join(str(tmp_path), "automap_rl", "jax")
  assert "--compilation-cache DIR|off" in out and f"now {stated}" in out
  path, files = out.split("CACHE ")[1].split()
  assert path == stated and int(files) > 0


@pytest.mark.parametrize(
  "flags, env_vars",
  [(["--compilation-cache", "off"], {}), ([], {compilation_cache.ENV: "0"})],
  ids=["flag", "variable"],
)
def test_the_flag_and_the_variable_turn_the_cache_off(tmp_path, flags, env_vars):
  out = run_cli(tmp_path, flags, **env_vars)
  assert "now off" in out and "CACHE None 0" in out
  assert not os.path.exists(os.path.join(str(tmp_path), "automap_rl"))


def test_a_directory_moves_the_cache_and_the_flag_wins_over_the_variables(tmp_path, monkeypatch):
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compilation_cache.directory() == os.path.join(str(tmp_path), "automap_rl", "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compilation_cache.directory() == str(tmp_path / "home" / ".cache" / "automap_rl" / "jax")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
  assert compilation_cache.directory() is None
  monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "moved"))
  assert compilation_cache.directory() == str(tmp_path / "moved")
  assert compilation_cache.directory("off") is None
  assert compilation_cache.directory(str(tmp_path / "flag")) == str(tmp_path / "flag")
