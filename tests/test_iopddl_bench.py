"""`automap-rl bench iopddl`: the contest's files from a git snapshot, points as the contest
scored them, and the winner's points on the same instances."""

import json

from experiments import cli

# The contest's example problem (its optimum costs 445).
EXAMPLE = {
  "problem": {
    "name": "example",
    "nodes": {
      "intervals": [[30, 70], [40, 70], [50, 120], [110, 140], [110, 150]],
      "costs": [[15], [55, 65], [25, 45, 35], [85, 75], [95]],
      "usages": [[10], [25, 25], [15, 20, 15], [10, 10], [15]],
    },
    "edges": {
      "nodes": [[0, 1], [0, 2], [1, 3], [2, 4], [3, 4]],
      "costs": [[30, 40], [50, 10, 40], [90, 10, 20, 80], [60, 20, 30], [70, 60]],
    },
    "usage_limit": 50,
  }
}


def test_contest_points_count_the_solver_as_one_more_team(tmp_path):
  """Points are best / cost per instance; a cost below every team's earns 1 and lowers the
  others' points there; the winner is the team with most points on the withheld instances."""
  from automap_rl.solver import load_results

  table = tmp_path / "results.csv"
  table.write_text("TEAM #,A,B,C\nteam01,10,20,40\nteam02,5,25,\n")
  results = load_results(table)
  assert results.best("B") == 20 and results.best("C") == 40 and results.best("Z") is None
  assert results.winner() == "team01"  # A is public: team02's better A does not count.
  assert results.points("B", 25) == 0.8 and results.points("C", None) == 0.0
  assert results.points("B", 10, ours=10) == 1.0
  assert results.points("B", 20, ours=10) == 0.5


def test_bench_extracts_the_contest_files_and_prints_points_against_the_winner(tmp_path, capsys):
  """From a bare git snapshot holding an instance and the results table, `bench iopddl` copies
  both into its directory and prints the instance's points and the winner's."""
  import gzip
  import subprocess

  work = tmp_path / "work"
  (work / "benchmarks").mkdir(parents=True)
  (work / "misc").mkdir()
  (work / "benchmarks" / "asplos-2025-iopddl-B.json.gz").write_bytes(
    gzip.compress(json.dumps(EXAMPLE).encode())
  )
  (work / "misc" / "iopddl_final_results.csv").write_text("TEAM #,B\nteam01,445\nteam02,500\n")
  git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
  subprocess.run(["git", "init", "-q", str(work)], check=True)
  subprocess.run(git + ["add", "-A"], check=True)
  subprocess.run(git + ["commit", "-qm", "files"], check=True)
  cache = tmp_path / "cache"
  args = ["bench", "iopddl", "--directories", str(cache), "--timeout", "5", "--workers", "0"]
  assert cli.main(args + ["--extract-from", str(work / ".git")]) == 0
  assert sorted(p.name for p in cache.iterdir()) == [
    "asplos-2025-iopddl-B.json.gz",
    "iopddl_final_results.csv",
  ]
  out = capsys.readouterr().out
  assert (
    "points on the 1 withheld instances held (B), per run: 1.000 vs the winner's (team01) 1.000"
    in out
  )


def test_bench_without_instances_names_the_directories(tmp_path, capsys):
  assert cli.main(["bench", "iopddl", "--directories", str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert "no asplos-2025-iopddl-*.json[.gz] in" in err and len(err.splitlines()) == 1
