"""Training steps around models that other people wrote: the ``external`` split.

Each family here wraps one whole model that ships inside a package from the package
index, built from a config with random weights (nothing is downloaded), into the zoo's
AdamW training step (:func:`automap_rl.workloads.training.build_workload`). The model
code is the package's own; these modules only build it, feeds it a random batch and
puts a loss on its output. Versions are those ``pyproject.toml`` pins (the
``external`` extra for ``transformers``):

* ``hf-gpt2``, ``hf-bert``, ``hf-vit``, ``hf-bart``: Hugging Face ``transformers``
  4.57.6, its Flax (linen) models ``FlaxGPT2LMHeadModel``, ``FlaxBertForMaskedLM``,
  ``FlaxViTForImageClassification`` and ``FlaxBartForConditionalGeneration``
  (``transformers`` 5 dropped Flax; its Flax T5 calls ``jnp.clip(a_max=...)``, which
  JAX 0.10 no longer takes, so T5 is left out). Dropout is off (``train=False``); the
  weights get gradients all the same.
* ``hk-resnet``: ``dm-haiku`` 0.0.17, ``hk.nets.ResNet`` in its ResNet-18 to 200
  configurations (``hk.nets.ResNet.CONFIGS``), with batch-norm statistics as state.
* ``jraph-gcn``, ``jraph-gat``: ``jraph`` 0.0.6.dev0, ``jraph.GraphConvolution``
  (Kipf and Welling 2017) and ``jraph.GAT`` (Velickovic et al. 2018) layers, node
  classification on one large graph; the layers' update and attention functions are
  Haiku ``hk.Linear`` as in jraph's examples.
* ``eqx-mlp``: ``equinox`` 0.13.8, ``eqx.nn.MLP``.

Spec strings as the zoo's: ``hf-gpt2:size=medium,batch=32``. The ``transformers``
families need the ``external`` extra (``pip install -e '.[external]'``); the others use
packages the project depends on anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from automap_rl.workloads import training
from automap_rl.workloads.external.equinox_mlp import MLP_PRESETS, EqxMLPConfig, make_mlp
from automap_rl.workloads.external.haiku_resnet import RESNET_PRESETS, HKResNetConfig, make_resnet
from automap_rl.workloads.external.huggingface import (
  BART_PRESETS,
  BERT_PRESETS,
  GPT2_PRESETS,
  VIT_PRESETS,
  HFBartConfig,
  HFBertConfig,
  HFConfig,
  HFGPT2Config,
  HFViTConfig,
  make_bart,
  make_bert,
  make_gpt2,
  make_vit,
)
from automap_rl.workloads.external.jraph_graphs import (
  GAT_PRESETS,
  GCN_PRESETS,
  GATConfig,
  GCNConfig,
  make_gat,
  make_gcn,
)

__all__ = [
  "BART_PRESETS",
  "BERT_PRESETS",
  "FAMILIES",
  "GAT_PRESETS",
  "GCN_PRESETS",
  "GPT2_PRESETS",
  "MLP_PRESETS",
  "RESNET_PRESETS",
  "VIT_PRESETS",
  "EqxMLPConfig",
  "Family",
  "GATConfig",
  "GCNConfig",
  "HFBartConfig",
  "HFBertConfig",
  "HFConfig",
  "HFGPT2Config",
  "HFViTConfig",
  "HKResNetConfig",
  "make_bart",
  "make_bert",
  "make_gat",
  "make_gcn",
  "make_gpt2",
  "make_mlp",
  "make_resnet",
  "make_vit",
]


@dataclasses.dataclass(frozen=True)
class Family:
  """An external family: its step builder, config class, presets and source.

  Attributes:
    make: ``make(config, seed) -> Workload``.
    config: the frozen config dataclass.
    presets: size label -> config fields.
    source: the package, its version and the model it ships.

  Every config's defaults are a reduced-size copy of its presets' structure: its arrays
  build, compile and run in seconds on CPU.
  """

  make: Callable[[Any, int], training.Workload]
  config: type
  presets: Mapping[str, Mapping[str, Any]]
  source: str


FAMILIES: dict[str, Family] = {
  "hf-gpt2": Family(
    make_gpt2, HFGPT2Config, GPT2_PRESETS, "transformers 4.57.6: FlaxGPT2LMHeadModel"
  ),
  "hf-bert": Family(
    make_bert, HFBertConfig, BERT_PRESETS, "transformers 4.57.6: FlaxBertForMaskedLM"
  ),
  "hf-vit": Family(
    make_vit, HFViTConfig, VIT_PRESETS, "transformers 4.57.6: FlaxViTForImageClassification"
  ),
  "hf-bart": Family(
    make_bart, HFBartConfig, BART_PRESETS, "transformers 4.57.6: FlaxBartForConditionalGeneration"
  ),
  "hk-resnet": Family(
    make_resnet, HKResNetConfig, RESNET_PRESETS, "dm-haiku 0.0.17: hk.nets.ResNet"
  ),
  "jraph-gcn": Family(make_gcn, GCNConfig, GCN_PRESETS, "jraph 0.0.6.dev0: jraph.GraphConvolution"),
  "jraph-gat": Family(make_gat, GATConfig, GAT_PRESETS, "jraph 0.0.6.dev0: jraph.GAT"),
  "eqx-mlp": Family(make_mlp, EqxMLPConfig, MLP_PRESETS, "equinox 0.13.8: eqx.nn.MLP"),
}
