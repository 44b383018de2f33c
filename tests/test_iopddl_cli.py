"""`automap-rl iopddl solve|evaluate` on the contest's example problem."""

import json
from pathlib import Path

import pytest

from experiments import cli

EXAMPLE = Path(__file__).resolve().parents[1].parent / "shared" / "iopddl" / "example.json"
pytestmark = pytest.mark.skipif(
  not EXAMPLE.exists(), reason="the IOPDDL data (../shared/iopddl) is absent"
)


def test_solve_writes_a_solution_that_evaluate_accepts(tmp_path, capsys):
  solution = tmp_path / "solution.json"
  assert (
    cli.main(["iopddl", "solve", str(EXAMPLE), "--timeout", "5", "--output", str(solution)]) == 0
  )
  assert (
    "cost 445  feasible True" in capsys.readouterr().out
  )  # The optimum (brute force over 12 plans).
  assert len(json.loads(solution.read_text())) == 5
  assert cli.main(["iopddl", "evaluate", str(EXAMPLE), str(solution)]) == 0


def test_evaluate_rejects_a_plan_over_the_memory_limit(tmp_path, capsys):
  solution = tmp_path / "solution.json"
  solution.write_text("[0, 0, 1, 0, 0]")  # At t in [50, 70): 10 + 25 + 20 = 55 > 50.
  assert cli.main(["iopddl", "evaluate", str(EXAMPLE), str(solution)]) == 2
  err = capsys.readouterr().err.strip()
  assert "is not a feasible solution" in err and len(err.splitlines()) == 1


def test_bench_refuses_fewer_than_one_copy(capsys):
  assert cli.main(["bench", "iopddl", "--directories", str(EXAMPLE.parent), "--copies", "0"]) == 2
  err = capsys.readouterr().err.strip()
  assert "--copies must be at least 1" in err and len(err.splitlines()) == 1
