"""Wrong input gets one line naming what is wrong, exit status 2, no traceback, and leaves
the user's files untouched."""

import pytest

from experiments import cli

CASES = [
  (
    ["partition", "--agent", "mcts", "--tactic", "fsdp"],
    "--tactic fsdp applies only with --agent tactic",
  ),
  (["partition", "--agent", "mcts", "--budget", "abc"], "bad budget 'abc'"),
  (["partition", "--agent", "mcts", "--budget", "0"], "a budget of 0 simulations searches nothing"),
  (["partition", "--agent", "mcts", "--budget", "0s"], "a budget of 0.0 seconds searches nothing"),
  (
    ["partition", "--agent", "mcts", "--checkpoint", "runs/small"],
    "--checkpoint applies only with --agent learned",
  ),
  (
    ["partition", "--agent", "learned", "--checkpoint", "/nonexistent/run"],
    "/nonexistent/run is no policy checkpoint",
  ),
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
  (["inspect", "gpt:layers=-1"], "gpt: layers=-1 must be a positive integer"),
  (["inspect", "gpt:batch=0"], "gpt: batch=0 must be a positive integer"),
  (["inspect", "gpt:heads=0"], "gpt: heads=0 must be a positive integer"),
  (["inspect", "vit:image_size=0"], "vit: image_size=0 must be a positive integer"),
  (
    ["partition", "mlp", "--mesh", "data=7"],
    "mesh data=7: no dimension of the program divides by any axis size (7)",
  ),
  (
    [
      "partition",
      "gpt:layers=1,d_model=32,heads=2,seq=8,vocab=32,batch=4",
      "--agent",
      "tactic",
      "--check-numerics",
      "--check-workload",
      "mlp",
    ],
    "the model to check is not a copy of the planned one",
  ),
  (["suite", "list", "--split", "validation"], "invalid choice 'validation'"),
  (["validate", "--random", "-3"], "--random -3: give a positive number of plans per model"),
  (["validate", "--models", "mlp"], "--models needs --random"),
  (["validate", "--random", "2", "--models", "mlp:widht=3"], "unknown key 'widht' for model 'mlp'"),
  (
    ["bench", "train", "--episodes", "6", "--devices", "1", "4"],
    "--episodes 6 does not split over 4 devices",
  ),
  (
    ["bench", "train", "--devices", "16"],
    "--devices 16: give a multiple of the 1 process(es), at most the 8 devices",
  ),
  (
    ["bench", "suite", "--best-known", "/nonexistent/best.json"],
    "--best-known /nonexistent/best.json: no such file",
  ),
  (
    ["bench", "suite", "--split", "test", "--families", "t5", "gpt"],
    "--families gpt: no such family in the test split",
  ),
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


def test_duplicate_argument_names_are_refused():
  import jax.numpy as jnp

  from automap_rl import ir

  with pytest.raises(ValueError, match=r"arg_names repeat \['params'\]"):
    ir.trace(lambda a, b: a + b, jnp.ones(2), jnp.ones(2), arg_names=("params", "params"))


def test_a_plan_that_does_not_fit_fails_loudly_with_exit_1(capsys, tmp_path):
  out = tmp_path / "plan.json"
  argv = [
    "partition",
    "gpt:layers=2,d_model=4096,heads=32,seq=2048,vocab=512,batch=64",
    "--mesh",
    "data=2,model=4",
    "--hardware",
    "tpu-v5e",
    "--agent",
    "tactic",
    "--json",
    str(out),
  ]
  assert cli.main(argv) == 1
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert (
    err.startswith("automap-rl partition: FAILED: the plan does not fit in memory: peak")
    and "would fit" in err
  )
  assert out.exists()  # The figures are written before the failure.
