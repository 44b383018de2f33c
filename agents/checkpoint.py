"""Checkpoints with orbax: the whole training state (for exact resume) and policies (for agents).

A run directory holds `checkpoints/<iteration>/` (orbax `CheckpointManager`, the whole
`TrainState`: parameters, optimizer state, replay buffer, key) and `policy/`, the latest
policy alone. A policy directory is what the `learned` agent and `evaluate` load:
`network.json` (the `NetworkConfig`) and `params/` (orbax). Both restore WITH a target
tree (the abstract state or parameters of a fresh initialisation), so arrays come back
with their exact shapes, dtypes and pytree structure.
"""

from __future__ import annotations

import dataclasses
import json
import os

import chex
import jax
import orbax.checkpoint as ocp

from agents.network import NetworkConfig

NETWORK_FILE = "network.json"
PARAMS_DIR = "params"
POLICY_DIR = "policy"
CHECKPOINTS_DIR = "checkpoints"
# Orbax marks a finished save with this file, written as "...successful to <absolute path>".
# Orbax only checks that it exists; `save_policy` rewrites it without the path, so that a
# policy directory (the shipped one included) names no machine's directories.
COMMIT_FILE = "commit_success.txt"
COMMIT_TEXT = "Checkpoint commit was successful"


def _abstract(tree: chex.ArrayTree) -> chex.ArrayTree:
  """Shapes, dtypes and shardings of `tree`: a leaf's own sharding (a training state
  replicated over the `data` mesh of every process), else this process's first device.
  Either way the devices are this run's, so a checkpoint written on a CPU restores onto
  a GPU, and one written by one process restores into many."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=getattr(x, "sharding", None) or device
    ),
    tree,
  )


def _without_empty(tree: chex.ArrayTree) -> chex.ArrayTree:
  """`tree` with None for its empty (zero-size) arrays."""
  return jax.tree.map(lambda x: None if x.size == 0 else x, tree)


class TrainCheckpoints:
  """The training states of a run directory, by iteration (keeps the latest `keep`). With
  several processes (`jax.distributed`) every one makes it and calls `save` and `restore`
  alike, on a directory they share; orbax writes each replicated array once and
  synchronises them."""

  def __init__(self, run_dir: str, keep: int = 2):
    self.manager = ocp.CheckpointManager(
      os.path.abspath(os.path.join(run_dir, CHECKPOINTS_DIR)),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def latest(self) -> int | None:
    """The iteration of the newest checkpoint, or None."""
    return self.manager.latest_step()

  def save(self, iteration: int, state: chex.ArrayTree) -> None:
    """Saves `state` as iteration `iteration` and waits until it is on disk (its empty
    arrays as None: orbax cannot write them; e.g. option features without options)."""
    self.manager.save(iteration, args=ocp.args.StandardSave(_without_empty(state)), force=True)
    self.manager.wait_until_finished()

  def restore(self, iteration: int, target: chex.ArrayTree) -> chex.ArrayTree:
    """The state saved at `iteration`, shaped as `target` (a state of the same run config),
    its empty arrays `target`'s."""
    restored = self.manager.restore(
      iteration, args=ocp.args.StandardRestore(_abstract(_without_empty(target)))
    )
    saved = jax.tree.leaves(restored, is_leaf=lambda x: x is None)
    return jax.tree.unflatten(
      jax.tree.structure(target),
      [
        empty if leaf is None else leaf
        for leaf, empty in zip(saved, jax.tree.leaves(target), strict=True)
      ],
    )

  def close(self) -> None:
    self.manager.close()


def save_policy(path: str, params: chex.ArrayTree, network: NetworkConfig) -> None:
  """Writes a policy directory (`network.json` and `params/`), replacing any there. With
  several processes every one calls it (orbax's save is collective); process 0 writes."""
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:  # Leaving the block waits for the save.
    checkpointer.save(os.path.join(path, PARAMS_DIR), params, force=True)
  if jax.process_index() != 0:
    return
  commit_file = os.path.join(path, PARAMS_DIR, COMMIT_FILE)
  if os.path.exists(commit_file):
    with open(commit_file, "w") as f:
      f.write(COMMIT_TEXT)
  with open(os.path.join(path, NETWORK_FILE), "w") as f:
    json.dump(dataclasses.asdict(network), f, indent=1)


def policy_dir(path: str) -> str:
  """The policy directory of `path`: `path` itself, or a run directory's `policy/`.

  Raises:
    ValueError: `path` is neither.
  """
  for candidate in (path, os.path.join(path, POLICY_DIR)):
    if os.path.isfile(os.path.join(candidate, NETWORK_FILE)) and os.path.isdir(
      os.path.join(candidate, PARAMS_DIR)
    ):
      return os.path.abspath(candidate)
  raise ValueError(
    f"{path} is no policy checkpoint (a directory with {NETWORK_FILE} and {PARAMS_DIR}/, "
    f"or a training run directory with {POLICY_DIR}/)."
  )


def read_network(path: str) -> NetworkConfig:
  """The `NetworkConfig` of a policy directory."""
  with open(os.path.join(policy_dir(path), NETWORK_FILE)) as f:
    return NetworkConfig(**json.load(f))


def load_params(path: str, target: chex.ArrayTree) -> chex.ArrayTree:
  """The parameters of a policy directory, restored onto the structure of `target`
  (parameters or their `jax.ShapeDtypeStruct`s from `Network.init`)."""
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(os.path.join(policy_dir(path), PARAMS_DIR), _abstract(target))
