"""Tests for the external split: models that ship inside other packages
(``automap_rl.workloads.external``), planned, lowered and checked (their abstract traces:
``tests/test_suite.py``)."""

import typing

import jax
import numpy as np
import pytest

from automap_rl import tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from automap_rl.workloads import EXTERNAL_FAMILIES, FAMILIES, SPLITS, external, load_cases
from automap_rl.xla.lower import lower
from automap_rl.xla.numerics import check_numerics

EXTERNAL = load_cases("external")


def _package(family: str) -> str:
  return external.FAMILIES[family].source.split()[0]


def test_the_external_split_holds_every_external_family_and_nothing_else():
  assert "external" in SPLITS and len(EXTERNAL) >= 12
  assert {c.family for c in EXTERNAL} == set(EXTERNAL_FAMILIES)
  assert len({_package(f) for f in EXTERNAL_FAMILIES}) >= 4
  assert set(EXTERNAL_FAMILIES).isdisjoint(FAMILIES)
  assert all(c.family in FAMILIES for c in load_cases() if c.split != "external")
  assert all(8 <= c.make_mesh().num_devices <= 64 for c in EXTERNAL)
  assert {"a100-40g", "a100-80g", "h100", "tpu-v5e"} <= {c.hardware for c in EXTERNAL}


def test_training_never_reads_the_external_split():
  from experiments import train_cmd

  assert typing.get_args(typing.get_type_hints(train_cmd.TrainRunConfig)["split"]) == (
    "smoke",
    "train",
  )
  for preset in train_cmd.PRESETS.values():
    read = train_cmd.pick_cases(load_cases(preset.split), preset.max_cases)
    assert read and not any(c.split == "external" or c.family in EXTERNAL_FAMILIES for c in read)


def test_suite_list_and_evaluate_take_the_external_split(capsys):
  from experiments import cli, evaluate_cmd

  assert cli.main(["suite", "list", "--split", "external"]) == 0
  out = capsys.readouterr().out
  assert (
    all(c.name in out for c in EXTERNAL)
    and f"{len(EXTERNAL)} cases (external {len(EXTERNAL)})" in out
  )
  chosen = evaluate_cmd.problems(evaluate_cmd.EvaluateConfig(split="external", max_cases=3))
  assert [family for _, family, _ in chosen] == ["hf-gpt2", "hf-bert", "hf-vit"]


@pytest.mark.parametrize(
  "spec, message",
  [
    (
      "hf-gpt2:size=huge",
      r"^unknown size 'huge' for model 'hf-gpt2'; valid sizes: small, medium, large, xl$",
    ),
    ("hk-resnet:depth=42", r"^depth=42 is not one of 18, 34, 50, 101, 152, 200$"),
    ("hf-bert:d_model=30,heads=4", r"^heads=4 must divide d_model=30$"),
    (
      "jraph-gcn:heads=2",
      r"^unknown key 'heads' for model 'jraph-gcn'; valid keys: n_node, .*, dtype, size$",
    ),
  ],
)
def test_bad_external_specs_are_one_line_errors(spec, message):
  with pytest.raises(ValueError, match=message):
    workloads.make_workload(spec, abstract=True)


# One reduced-size model per package: the lowered plan shards the parameters over `model`
# and the batch over `data`, and computes the unpartitioned step's numbers. The ResNet
# (18 convolutions with batch norm: most of a minute to compile on 2 cores) is slow.
LOWERED = [
  "hf-gpt2:layers=1,d_model=32,heads=2,seq=8,vocab=64",
  pytest.param("hk-resnet:depth=18,width=4,image_size=8", marks=pytest.mark.slow),
  "jraph-gcn",
  "eqx-mlp",
]


@pytest.mark.parametrize("spec", LOWERED)
def test_a_reduced_model_of_each_package_lowers_with_a_sharded_plan_and_right_numerics(spec):
  workload = workloads.make_workload(spec)
  problem = Problem.build(workload.trace(), make_mesh("data=2,model=4", "cpu"))
  decisions = tactics.data_megatron(problem)
  lowered = lower(problem, decisions, workload.step, workload.args, isolated=False)
  specs = [s.spec for s in jax.tree_util.tree_leaves(lowered.in_shardings[0])]
  assert any("model" in jax.tree_util.tree_leaves(tuple(s)) for s in specs)
  assert any(c.mesh_axes == ("data",) for c in lowered.stats.collectives)
  check_numerics(workload.step, workload.args, lowered)
  assert np.isfinite(float(lowered.run(workload.args)[-1]))
