"""Checkpoints with orbax: the whole training state (for exact resume) and policies (for agents).

A run directory holds `checkpoints/<iteration>/` (the whole `TrainState`: parameters,
optimizer state, replay buffer, key) and `policy/`, the latest policy alone. A policy
directory is what the `learned` agent and `evaluate` load: `network.json` (the
`NetworkConfig`) and `params/` (orbax). Both restore WITH a target tree (the abstract state
or parameters of a fresh initialisation), so arrays come back with their exact shapes,
dtypes and pytree structure.

Atomic saves. A checkpoint is written whole into `checkpoints/<iteration>.partial/`
(orbax's arrays in `default/`, then `saved.json` with the SHA-256 of every leaf), which
one rename makes `checkpoints/<iteration>/`; a policy is written into `policy.partial/`
and swapped in by renames. A process killed at any point leaves the last complete
checkpoint intact and at most a `.partial` directory, which is removed, never read. A
checkpoint directory whose arrays do not restore, or restore to other bytes than
`saved.json` records (a torn copy, a damaged disk), is skipped with a warning and the
one before it is loaded.

Fault injection (tests). `$AUTOMAP_RL_KILL_AT=POINT:ITERATION` makes the process SIGKILL
itself at POINT of the save of that iteration (`kill_point`): `save-begin` (nothing
written), `save-written` (the arrays in the `.partial` directory, not renamed),
`save-committed` (the checkpoint complete, the policy not yet written), `policy-written`
(the new policy beside the old one, not swapped in).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import signal
import sys

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp

from agents.network import NetworkConfig

NETWORK_FILE = "network.json"
PARAMS_DIR = "params"
POLICY_DIR = "policy"
CHECKPOINTS_DIR = "checkpoints"
STATE_ITEM = "default"  # The state's directory in a checkpoint (orbax CheckpointManager's name).
SAVED_FILE = "saved.json"  # A checkpoint's leaf digests, written last.
PARTIAL = ".partial"  # Suffix of a checkpoint or policy being written.
# Orbax marks a finished save with this file, written as "...successful to <absolute path>".
# Orbax only checks that it exists; `save_policy` rewrites it without the path, so that a
# policy directory (the shipped one included) names no machine's directories.
COMMIT_FILE = "commit_success.txt"
COMMIT_TEXT = "Checkpoint commit was successful"
KILL_ENV = "AUTOMAP_RL_KILL_AT"
BARRIER_TIMEOUT_MS = 3600 * 1000


def kill_point(point: str, iteration: int) -> None:
  """The fault-injection hook: SIGKILLs this process when `$AUTOMAP_RL_KILL_AT` is
  `point:iteration` (see the module docstring); nothing otherwise."""
  if os.environ.get(KILL_ENV) == f"{point}:{iteration}":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


_barriers = itertools.count()  # Every process passes the same barriers in the same order.


def barrier(name: str) -> None:
  """Waits until every process gets here (no-op with one process): a barrier of
  `jax.distributed`'s coordination service, not a collective."""
  if jax.process_count() > 1:
    ocp.multihost.get_barrier_sync_fn()(
      key=f"{name} #{next(_barriers)}", timeout_ms=BARRIER_TIMEOUT_MS
    )


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


def digests(tree: chex.ArrayTree) -> list[str]:
  """The SHA-256 of each leaf's bytes (a replicated global array read from this process's
  first shard), in `jax.tree.leaves` order."""
  host = [
    np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
    for x in jax.tree.leaves(tree)
  ]
  return [hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest() for x in host]


def _replace_dir(partial: str, path: str) -> None:
  """Puts the finished directory `partial` at `path` by renames (the old one, if any, moved
  aside first and then removed)."""
  old = path + ".old"
  if os.path.exists(path):
    shutil.rmtree(old, ignore_errors=True)
    os.rename(path, old)
  os.rename(partial, path)
  shutil.rmtree(old, ignore_errors=True)


class TrainCheckpoints:
  """The training states of a run directory, by iteration (keeps the latest `keep`). With
  several processes (`jax.distributed`) every one makes it and calls `save` and `restore`
  alike, on a directory they share; orbax writes each replicated array once, process 0
  commits."""

  def __init__(self, run_dir: str, keep: int = 2):
    self.root = os.path.abspath(os.path.join(run_dir, CHECKPOINTS_DIR))
    self.keep = keep
    self.checkpointer = ocp.StandardCheckpointer()
    os.makedirs(self.root, exist_ok=True)
    barrier("made the checkpoint directory")
    if jax.process_index() == 0:
      for name in sorted(os.listdir(self.root)):
        if not name.isdigit():
          print(
            f"warning: removing {os.path.join(self.root, name)}, a save that did not finish",
            file=sys.stderr,
          )
          shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
    barrier("cleared unfinished checkpoints")

  def steps(self) -> list[int]:
    """The iterations of the complete checkpoints (committed by their rename), oldest first."""
    return sorted(int(n) for n in os.listdir(self.root) if n.isdigit())

  def latest(self) -> int | None:
    """The iteration of the newest checkpoint, or None."""
    return (self.steps() or [None])[-1]

  def _path(self, iteration: int) -> str:
    return os.path.join(self.root, str(iteration))

  def save(self, iteration: int, state: chex.ArrayTree) -> None:
    """Saves `state` as iteration `iteration` (its empty arrays as None: orbax cannot
    write them; e.g. option features without options) and returns once it is committed."""
    kill_point("save-begin", iteration)
    partial = self._path(iteration) + PARTIAL
    self.checkpointer.save(os.path.join(partial, STATE_ITEM), _without_empty(state), force=True)
    self.checkpointer.wait_until_finished()
    sums = digests(state)
    kill_point("save-written", iteration)
    barrier(f"wrote checkpoint {iteration}")
    if jax.process_index() == 0:
      with open(os.path.join(partial, SAVED_FILE), "w") as f:
        json.dump({"iteration": iteration, "sha256": sums}, f)
        f.flush()
        os.fsync(f.fileno())
      _replace_dir(partial, self._path(iteration))
      for old in self.steps()[: -self.keep]:
        shutil.rmtree(self._path(old), ignore_errors=True)
    barrier(f"committed checkpoint {iteration}")
    kill_point("save-committed", iteration)

  def restore(self, iteration: int, target: chex.ArrayTree) -> chex.ArrayTree:
    """The state saved at `iteration`, shaped as `target` (a state of the same run config),
    its empty arrays `target`'s.

    Raises:
      ValueError: the checkpoint is torn: its arrays do not restore, or not to the bytes
        its `saved.json` records.
    """
    path = self._path(iteration)
    try:
      restored = self.checkpointer.restore(
        os.path.join(path, STATE_ITEM), _abstract(_without_empty(target))
      )
    except Exception as e:  # Orbax and tensorstore raise many kinds for a damaged directory.
      raise ValueError(f"checkpoint {path} does not restore: {str(e).splitlines()[0]}") from e
    saved = jax.tree.leaves(restored, is_leaf=lambda x: x is None)
    state = jax.tree.unflatten(
      jax.tree.structure(target),
      [
        empty if leaf is None else leaf
        for leaf, empty in zip(saved, jax.tree.leaves(target), strict=True)
      ],
    )
    record = os.path.join(path, SAVED_FILE)
    if os.path.exists(record):  # Absent in checkpoints written before it was.
      with open(record) as f:
        want = json.load(f)["sha256"]
      if digests(state) != want:
        raise ValueError(f"checkpoint {path} restores to other bytes than it saved")
    return state

  def restore_latest(self, target: chex.ArrayTree) -> tuple[int, chex.ArrayTree]:
    """The newest checkpoint that restores whole, and its iteration; `(0, target)` when
    there is none. Each torn one on the way is skipped with a warning on stderr."""
    for iteration in reversed(self.steps()):
      try:
        return iteration, self.restore(iteration, target)
      except ValueError as e:
        print(f"warning: skipping a torn checkpoint: {e}", file=sys.stderr)
    return 0, target

  def close(self) -> None:
    self.checkpointer.close()


def save_policy(
  path: str, params: chex.ArrayTree, network: NetworkConfig, iteration: int = 0
) -> None:
  """Writes a policy directory (`network.json` and `params/`), replacing any there
  atomically (written beside it, then renamed in). With several processes every one calls
  it (orbax's save is collective); process 0 writes the rest. `iteration` only names the
  save for `kill_point`."""
  path = os.path.abspath(path)
  partial = path + PARTIAL
  if jax.process_index() == 0:
    shutil.rmtree(partial, ignore_errors=True)
  barrier("cleared the policy's partial directory")
  with ocp.StandardCheckpointer() as checkpointer:  # Leaving the block waits for the save.
    checkpointer.save(os.path.join(partial, PARAMS_DIR), params, force=True)
  barrier("wrote the policy")
  if jax.process_index() == 0:
    commit_file = os.path.join(partial, PARAMS_DIR, COMMIT_FILE)
    if os.path.exists(commit_file):
      with open(commit_file, "w") as f:
        f.write(COMMIT_TEXT)
    with open(os.path.join(partial, NETWORK_FILE), "w") as f:
      json.dump(dataclasses.asdict(network), f, indent=1)
    kill_point("policy-written", iteration)
    _replace_dir(partial, path)
  barrier("swapped the policy in")


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
