"""Every Python snippet in the README runs as written, in a fresh interpreter."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_snippets():
  assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_written(index, tmp_path):
  env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}  # The snippet sets its own.
  result = subprocess.run([sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
