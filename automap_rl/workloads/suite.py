"""The task suite: partitioning cases stored as data in ``suite.json``.

A case is a workload spec (a family at a published size, see
:mod:`automap_rl.workloads.spec`), a mesh spec of 8 to 1,024 devices with 2 or 3
axes, and a hardware profile (:func:`automap_rl.mesh.get_hardware`). Each of
GPT, Llama, T5 and the SSM also has a case at the scale its published runs
trained: GPT-175B at 1,536 sequences of 2,048 on 1,024 H100s (GPT-3's batch),
Llama-70B at 1,024 x 4,096 on 512 A100s (Llama 2's 4M tokens), T5-XXL at 2,048 x
512 on 1,024 TPU v4 chips (T5's pre-training batch) and Mamba-2.8B at 512 x
2,048 on 256 A100s (Mamba's 1M tokens), where pipelines and gradient
accumulation matter.
``make_mesh`` gives every axis its link from the hardware's node size
(:func:`automap_rl.mesh.axis_links`): on GPUs (8 per node) the minor axes
that fit in a node run over NVLink and the major ones over InfiniBand, so
``data=8,model=8`` has a fast ``model`` axis and a slow ``data`` axis; TPU
v5e slices of up to 256 chips are all ICI.

Splits:

* ``smoke``: a few tiny cases that trace in seconds, for tests.
* ``train`` and ``test``: published sizes, disjoint by family. The train
  families are GPT, Llama, MoE, ViT, Wide-ResNet, the mesh GNNs, wide MLPs,
  LSTM language models (a recurrence unlike Mamba's: gated cells, no state
  expansion) and the diffusion transformer (DiT). The test
  families are T5 (an encoder-decoder with cross-attention), the diffusion
  U-Net (convolutions, skips and attention at several resolutions) and the
  Mamba SSM (a recurrence scanned over time): each recombines parts the train
  families have (attention, gated MLPs, convolutions, normalization, scanned
  layers) into a structure none of them has, and together they cover three
  of the four framework styles (Haiku, Flax linen, Equinox), each of which
  also appears in train.
* ``external``: models nobody here wrote, from the code that ships inside
  other packages (Hugging Face ``transformers``' Flax GPT-2, BERT, ViT and
  BART, Haiku's ResNets, jraph's GCN and GAT, Equinox's MLP; see
  :mod:`automap_rl.workloads.external`) at published sizes. For evaluation
  only: training reads ``smoke`` or ``train``. Only this split holds the
  external families.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json

from automap_rl import mesh as mesh_lib
from automap_rl.workloads import spec as spec_lib
from automap_rl.workloads import training

SPLITS: tuple[str, ...] = ("smoke", "train", "test", "external")
MAX_DEVICES = 1024  # GPT-175B at GPT-3's batch: 128 nodes of 8 GPUs, traced abstractly.


@dataclasses.dataclass(frozen=True)
class Case:
  """One partitioning task.

  Attributes:
    name: unique name, e.g. ``"gpt-1.3b-2x4-h100"``.
    workload: workload spec, e.g. ``"gpt:size=1.3b,batch=16"``.
    family: the spec's family, e.g. ``"gpt"``.
    size: the spec's preset label, or ``"tiny"`` for smoke cases.
    mesh: mesh spec, e.g. ``"data=2,model=4"``.
    hardware: hardware profile name.
    split: one of :data:`SPLITS`.
  """

  name: str
  workload: str
  family: str
  size: str
  mesh: str
  hardware: str
  split: str

  def make_mesh(self) -> mesh_lib.Mesh:
    """The case's mesh with its hardware and per-axis links."""
    return mesh_lib.make_mesh(self.mesh, self.hardware)

  def make_workload(self, abstract: bool = True) -> training.Workload:
    """The case's workload; abstract (nothing allocated) by default."""
    return spec_lib.make_workload(self.workload, abstract=abstract)


def _size_label(workload: str) -> str:
  for item in workload.partition(":")[2].split(","):
    key, _, value = (s.strip() for s in item.partition("="))
    if key == "size":
      return value
  return "tiny"


def _case(entry: dict[str, str]) -> Case:
  """A validated :class:`Case` from one ``suite.json`` entry."""
  name = entry["name"]
  if entry["split"] not in SPLITS:
    raise ValueError(f"case {name!r}: unknown split {entry['split']!r}")
  family, _ = spec_lib.parse_model_spec(entry["workload"])
  if (family in spec_lib.EXTERNAL_FAMILIES) != (entry["split"] == "external"):
    raise ValueError(
      f"case {name!r}: family {family!r} does not belong in split {entry['split']!r} "
      "(the external split holds exactly the external families)"
    )
  mesh = mesh_lib.make_mesh(entry["mesh"], entry["hardware"])
  if not 8 <= mesh.num_devices <= MAX_DEVICES or len(mesh.axis_names) not in (2, 3):
    raise ValueError(
      f"case {name!r}: mesh {entry['mesh']!r} is not 8 to {MAX_DEVICES} devices on 2 or 3 axes"
    )
  return Case(
    name=name,
    workload=entry["workload"],
    family=family,
    size=_size_label(entry["workload"]),
    mesh=entry["mesh"],
    hardware=entry["hardware"],
    split=entry["split"],
  )


@functools.cache
def _all_cases() -> tuple[Case, ...]:
  text = importlib.resources.files(__package__).joinpath("suite.json").read_text()
  cases = tuple(_case(entry) for entry in json.loads(text)["cases"])
  names = [c.name for c in cases]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate case names: {sorted({n for n in names if names.count(n) > 1})}")
  return cases


def load_cases(split: str | None = None) -> list[Case]:
  """The suite's cases of ``split`` (every split when None), in file order.

  Raises:
    ValueError: ``split`` is not one of :data:`SPLITS`.
  """
  if split is not None and split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
  return [c for c in _all_cases() if split is None or c.split == split]
