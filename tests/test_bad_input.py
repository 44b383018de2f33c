"""Wrong input gets one line naming what is wrong, exit status 2, no traceback, and leaves
the user's files untouched."""

import pytest

from experiments import cli

CASES = [
    (["partition", "--agent", "mcts", "--tactic", "fsdp"], "--tactic fsdp applies only with --agent tactic"),
    (["partition", "--agent", "mcts", "--budget", "abc"], "bad budget 'abc'"),
    (["partition", "--agent", "mcts", "--budget", "0"], "a budget of 0 simulations searches nothing"),
    (["partition", "--agent", "mcts", "--budget", "0s"], "a budget of 0.0 seconds searches nothing"),
    (["partition", "--json", "/nonexistent/x.json"], "the directory /nonexistent does not exist"),
    (["partition", "--plot", "/nonexistent/x.png"], "cannot write --plot /nonexistent/x.png"),
    (["inspect", "gpt:layerz=2"], "unknown key 'layerz' for model 'gpt'"),
    (["inspect", "gpt:layers"], "bad item 'layers'"),
    (["inspect", "gpt:layers=two"], "bad value 'two' for key 'layers'"),
    (["inspect", "nosuchfamily"], "unknown model 'nosuchfamily'"),
    (["partition", "--mesh", "data=0", "mlp"], "data"),
    (["partition", "--mesh", "data", "mlp"], "data"),
    (["partition", "--hardware", "v100"], "invalid choice 'v100' for argument '--hardware'"),
    (["env", "--action-space", "everything"], "invalid choice 'everything'"),
    (["bench", "simulator", "--batch", "many"], "Error parsing --batch"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_wrong_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
  keep = tmp_path / "keep.json"  # A file the user passed in: the failed command must not touch it.
  keep.write_text("{}")
  if "--json" not in argv:
    argv = [*argv, "--json", str(keep)]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert message in err, err
  assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert keep.read_text() == "{}"


def test_a_directory_is_not_an_output_file(capsys, tmp_path):
  assert cli.main(["inspect", "--json", str(tmp_path)]) == 2
  assert "is a directory" in capsys.readouterr().err
