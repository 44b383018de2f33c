"""`automap-rl train --preset smoke|small|medium|full [--FIELD VALUE ...]`: self-play training on
the task suite.

A preset gives every field a default (`PRESETS`); any flag overrides it, the training
fields as `--train.FIELD` (`--train.network.width 32`). The run directory gets
`config.json`, `metrics.jsonl` (one line per iteration), orbax checkpoints of the whole
training state (`checkpoints/`), the latest policy (`policy/`, what `evaluate --checkpoint`
and the `learned` agent load), a learning curve (`learning_curve.png`) and wandb's files
(offline by default; nothing goes over the network unless `--wandb online`). Running again
into a run directory that has checkpoints resumes from the newest one and continues
exactly as the uninterrupted run would have, and continues its wandb run (the run id is
kept in `wandb_run_id.txt`).

Devices. The episodes and minibatches are sharded over every device of every process
(`agents.train.data_mesh`; `--devices N` takes fewer), which must divide
`--train.episodes` and `--train.batch-size`. A preset's own sizes fit any device count
(`fit_devices`: it uses the devices that split them, or rounds them up, and says which);
sizes given on the command line must split. Several processes (hosts) join through
`--distributed.*` or the environment (`experiments.distributed`); each runs the same
command on a run directory they share, and process 0 alone writes the metrics, wandb,
the learning curve and the policy's `network.json`. A checkpoint restores onto any
device count: the run resumes exactly, up to the order of the gradient all-reduce's sums.

Faults. Checkpoints are atomic (`agents.checkpoint`): a run killed at any point resumes
from its last complete checkpoint, and one torn on disk is skipped with a warning. A
SIGTERM (or the platform's preemption notice) makes every process save the same iteration,
the next boundary (`agents.preemption`), print where, and exit 0. A lost process ends the
others within `--distributed.peer-timeout` seconds (`experiments.distributed`). Rerunning
the same command on every process resumes, and ends with the parameters of an
uninterrupted run, bit for bit: the metrics file is rewritten atomically and keeps the
iterations up to the checkpoint resumed, and wandb gets each iteration once, when it is
checkpointed (`wandb_logged.txt` holds the last it got).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from tqdm import tqdm

from agents import checkpoint, imitation, preemption, selfplay, train
from agents.gumbel import GumbelSettings
from agents.network import NetworkConfig
from agents.train import TrainConfig, TrainState
from automap_rl.plan import plan_from_json
from automap_rl.workloads.suite import Case, load_cases
from experiments import distributed, suite_cmd
from experiments.distributed import DistributedConfig, initialize

Preset = Literal["smoke", "small", "medium", "full"]
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
CURVE_FILE = "learning_curve.png"
WANDB_ID_FILE = "wandb_run_id.txt"
WANDB_LOGGED_FILE = "wandb_logged.txt"


@dataclasses.dataclass(frozen=True)
class TrainRunConfig:
  """A training run.

  Attributes:
    preset: the preset whose values are the defaults of every other field (given first).
    split: the task-suite split to train on.
    max_cases: use at most this many cases of the split, taken in turn from each family
      (None: all).
    iterations: self-play iterations of the whole run (a resumed run counts the ones done).
    run_dir: the run directory (created; a run in it with checkpoints is resumed).
    checkpoint_every: save the training state and the policy every this many iterations
      (and after the last).
    wandb: wandb's mode: offline (local files only), disabled, or online (needs a login).
    progress: show progress bars.
    learning_curve: draw the learning curve into the run directory.
    devices: shard over this many devices, as many from each process (None: all of them).
    fit_devices: when the devices do not split the episodes or the minibatch, fit them
      (`fit_devices`): without `devices`, use the most devices that split both; with it,
      round both up to a multiple of it; either way one line says which. Off when
      `--train.episodes` or `--train.batch-size` is given: those must split.
    imitation_updates: optimizer steps on the best-known plans of the run's cases
      (`agents.imitation`) before the first iteration; 0: none.
    best_known: the best-known plans the imitation warm start learns from (None: the
      suite's own).
    imitation_climbs: the warm start also learns, at each expert plan of the run's cases
      that fits, the simulator's best refinement step by step until none improves, then
      `stop` (`agents.imitation.climb_samples`).
    init_policy: start from this policy's parameters (a policy or run directory, of the
      same network sizes and pipeline options as `train.network`) rather than fresh ones:
      fine-tuning, with a fresh optimizer and an empty replay buffer (before any warm start).
    distributed: how this process joins a multi-process run (`experiments.distributed`).
    train: what self-play and the updates do (`agents.train.TrainConfig`).
  """

  preset: Preset = "small"
  split: Literal["smoke", "train"] = "train"
  max_cases: int | None = None
  iterations: int = 240
  run_dir: str = "runs/small"
  checkpoint_every: int = 20
  wandb: Literal["offline", "disabled", "online"] = "offline"
  progress: bool = True
  learning_curve: bool = True
  devices: int | None = None
  fit_devices: bool = True
  imitation_updates: int = 0
  best_known: str | None = None
  imitation_climbs: bool = False
  init_policy: str | None = None
  distributed: DistributedConfig = DistributedConfig()
  train: TrainConfig = TrainConfig()


PRESETS: dict[str, TrainRunConfig] = {
  "smoke": TrainRunConfig(
    preset="smoke",
    split="smoke",
    max_cases=2,
    iterations=3,
    run_dir="runs/smoke",
    checkpoint_every=1,
    train=TrainConfig(
      episodes=4,
      episode_length=4,
      gumbel=GumbelSettings(num_simulations=8, max_num_considered_actions=4),
      replay_capacity=256,
      batch_size=16,
      updates=2,
      warmup_updates=4,
      network=NetworkConfig(width=32, rounds=2, state_width=16, pipelines=5),
    ),
  ),
  "small": TrainRunConfig(),
  # The small recipe half as long again, after a warm start on the train split's best-known plans.
  "medium": TrainRunConfig(
    preset="medium", iterations=360, run_dir="runs/medium", imitation_updates=300
  ),
  # The medium recipe sized for an accelerator: the same warm start, then twice the
  # episodes, simulations and considered actions per move, minibatch and updates, 16-step
  # episodes, 2000 iterations.
  "full": TrainRunConfig(
    preset="full",
    iterations=2000,
    run_dir="runs/full",
    checkpoint_every=50,
    imitation_updates=300,
    train=TrainConfig(
      episodes=16,
      episode_length=16,
      gumbel=GumbelSettings(num_simulations=32, max_num_considered_actions=16),
      replay_capacity=16384,
      batch_size=128,
      updates=16,
    ),
  ),
}


def preset_defaults(argv: Sequence[str]) -> TrainRunConfig:
  """The preset `--preset NAME` (or `--preset=NAME`) in `argv` names; `small` without one.
  An unknown name gives `small` here and tyro's one-line error on `--preset`."""
  name = "small"
  for i, arg in enumerate(argv):
    if arg == "--preset" and i + 1 < len(argv):
      name = argv[i + 1]
    elif arg.startswith("--preset="):
      name = arg.partition("=")[2]
  preset = PRESETS.get(name, PRESETS["small"])
  if any(arg.replace("_", "-").split("=")[0] in SPLIT_FLAGS for arg in argv):
    return dataclasses.replace(preset, fit_devices=False)  # The user's sizes must split.
  return preset


SPLIT_FLAGS = ("--train.episodes", "--train.batch-size")  # What the data axis must divide.


def fit_devices(config: TrainRunConfig) -> tuple[TrainRunConfig, str | None]:
  """`config` fitted to this run's devices (`TrainRunConfig.fit_devices`), and the line
  that says how (None: it fits as it is). Without `devices`: the most devices, as many
  from each process, that split the episodes and the minibatch (the training is the
  same as on all of them, up to the all-reduce's order); if no count does, all devices
  with both rounded up. With `devices`: both rounded up to a multiple of it."""
  t = config.train
  if not config.fit_devices:
    return config, None
  processes, have = jax.process_count(), jax.device_count()
  n = config.devices
  if n is None:
    fits = [
      n
      for n in range(processes, have + 1, processes)
      if t.episodes % n == 0 and t.batch_size % n == 0
    ]
    if fits and fits[-1] < have:
      return dataclasses.replace(config, devices=fits[-1]), (
        f"--preset {config.preset}: {fits[-1]} of the {have} devices, the most that split its "
        f"{t.episodes} episodes and minibatch of {t.batch_size} (--devices N rounds them up "
        "instead)"
      )
    n = have
  episodes, batch = -(-t.episodes // n) * n, -(-t.batch_size // n) * n
  if (episodes, batch) == (t.episodes, t.batch_size):
    return config, None
  return dataclasses.replace(
    config, train=dataclasses.replace(t, episodes=episodes, batch_size=batch)
  ), (
    f"--preset {config.preset}: its {t.episodes} episodes and minibatch of {t.batch_size} "
    f"rounded up to {episodes} and {batch} to split over {n} devices"
  )


def pick_cases(cases: Sequence[Case], limit: int | None) -> list[Case]:
  """At most `limit` cases (None: all), one from each family in turn (file order within a
  family)."""
  by_family: dict[str, list[Case]] = {}
  for case in cases:
    by_family.setdefault(case.family, []).append(case)
  turns = itertools.zip_longest(*by_family.values())
  return [case for turn in turns for case in turn if case is not None][:limit]


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """What a run leaves: its directory, final state and every iteration's metrics."""

  run_dir: str
  state: TrainState
  metrics: list[dict[str, Any]]


def _check_config(config: TrainRunConfig) -> None:
  if config.iterations < 1 or config.checkpoint_every < 1:
    raise ValueError("--iterations and --checkpoint-every must be at least 1.")
  t = config.train
  if t.batch_size < 1 or t.episodes < 1 or t.episode_length < 1 or t.gumbel.num_simulations < 1:
    raise ValueError(
      "--train.batch-size, episodes, episode-length and gumbel.num-simulations must be at least 1."
    )
  if t.expert_start_every < 0:
    raise ValueError(f"--train.expert-start-every {t.expert_start_every}: give 0 (never) or more.")
  if config.init_policy is not None:
    network = checkpoint.read_network(
      config.init_policy
    )  # Raises for a directory without a policy.
    if network != t.network:
      raise ValueError(
        f"--init-policy {config.init_policy}: its network {network} is not --train.network "
        f"{t.network}"
      )
  if config.imitation_updates < 0:
    raise ValueError(f"--imitation-updates {config.imitation_updates}: give 0 (none) or more.")
  if config.imitation_climbs and not config.imitation_updates:
    raise ValueError(
      "--imitation-climbs: the climbs are learned in the warm start; give --imitation-updates too."
    )
  if config.imitation_updates:
    known = suite_cmd.load_best_known(config.best_known).get("cases", {})
    cases = pick_cases(load_cases(config.split), config.max_cases)
    if not any(c.name in known for c in cases):
      raise ValueError(
        f"--imitation-updates {config.imitation_updates}: none of the {len(cases)} {config.split} "
        "cases has a best-known plan to imitate"
      )
  if t.episodes * t.episode_length > t.replay_capacity:
    raise ValueError(
      f"an iteration's {t.episodes * t.episode_length} samples do not fit the replay buffer "
      f"of {t.replay_capacity}; raise --train.replay-capacity."
    )


def is_lead() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


def _prepare_dir(config: TrainRunConfig) -> None:
  """Creates the run directory; refuses one holding a run of another training config.
  Every process checks before process 0 writes."""
  os.makedirs(config.run_dir, exist_ok=True)
  path = os.path.join(config.run_dir, CONFIG_FILE)
  document = dataclasses.asdict(config)
  if os.path.exists(path):
    with open(path) as f:
      before = json.load(f)
    # A field added to TrainConfig since the run was written reads as its default.
    written = {
      **json.loads(json.dumps(dataclasses.asdict(TrainConfig()))),
      **before.get("train", {}),
    }
    if written != json.loads(json.dumps(document["train"])):
      raise ValueError(
        f"{config.run_dir} holds a run with another --train config; give a new --run-dir."
      )
  checkpoint.barrier("checked the run directory")
  if is_lead():
    with open(path, "w") as f:
      json.dump(document, f, indent=1)


def _read_metrics(run_dir: str, upto: int) -> list[dict[str, Any]]:
  """The metrics lines of iterations 1..`upto` (a run stopped after its last checkpoint
  may have logged more; those iterations are run again)."""
  path = os.path.join(run_dir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r["iteration"] <= upto]


def _write_metrics(run_dir: str, rows: list[dict[str, Any]]) -> None:
  """Replaces the metrics file by `rows`, atomically (written beside it, then renamed)."""
  path = os.path.join(run_dir, METRICS_FILE)
  with open(path + ".partial", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  os.replace(path + ".partial", path)


def _log_wandb(logger, run_dir: str, rows: list[dict[str, Any]], upto: int) -> None:
  """Logs to wandb the rows of iterations up to `upto` (a checkpointed one) that it has not
  had (`WANDB_LOGGED_FILE` holds the last one it had): an iteration run again after a
  resume is logged once, when it is checkpointed."""
  if logger is None:
    return
  path = os.path.join(run_dir, WANDB_LOGGED_FILE)
  logged = 0
  if os.path.exists(path):
    with open(path) as f:
      logged = int(f.read())
  for row in rows:
    if logged < row["iteration"] <= upto:
      logger.log({k: v for k, v in row.items() if k != "iteration"}, step=row["iteration"])
  with open(path + ".partial", "w") as f:
    f.write(str(max(logged, upto)))
  os.replace(path + ".partial", path)


def wandb_run(config: TrainRunConfig):
  """The run directory's wandb run (offline: files under the run directory only), or None
  when disabled. Its id is kept in the run directory, so that a resumed run continues it."""
  if config.wandb == "disabled":
    return None
  import wandb

  # Our package named `agents` is no LLM-agents library: skip wandb's Weave suggestion.
  os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
  id_file = os.path.join(config.run_dir, WANDB_ID_FILE)
  if os.path.exists(id_file):
    with open(id_file) as f:
      run_id = f.read().strip()
  else:
    run_id = uuid.uuid4().hex[:8]  # wandb's form: 8 characters of [0-9a-z].
    with open(id_file, "w") as f:
      f.write(run_id)
  return wandb.init(
    project="automap_rl",
    dir=os.path.abspath(config.run_dir),
    mode=config.wandb,
    id=run_id,
    resume="allow",
    name=os.path.basename(os.path.abspath(config.run_dir)),
    config=dataclasses.asdict(config),
    settings=wandb.Settings(silent=True),
  )


def plot_curve(rows: list[dict[str, Any]], path: str) -> None:
  """The learning curve: the episodes' mean return and the losses per iteration (PNG)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  x = [r["iteration"] for r in rows]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
  top.plot(x, [r["score"] for r in rows], label="mean return log(best expert / plan)")
  top.axhline(0.0, color="gray", lw=0.8, ls="--")
  top.set_ylabel("return")
  top.legend(loc="lower right")
  for name in ("policy_kl", "value_loss"):
    bottom.plot(x, [r[name] for r in rows], label=name)
  bottom.set_yscale("log")
  bottom.set_xlabel("iteration")
  bottom.set_ylabel("loss")
  bottom.legend(loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def build_suite(config: TrainRunConfig) -> tuple[list[Case], selfplay.Suite]:
  """The run's cases and their suite (traced and built with a progress bar)."""
  cases = pick_cases(load_cases(config.split), config.max_cases)
  problems = [
    selfplay.case_problem(c)
    for c in tqdm(
      cases, desc="tracing cases", unit="case", disable=not config.progress, dynamic_ncols=True
    )
  ]
  return cases, selfplay.build_suite(
    tuple(problems), config.train.env, config.train.expert_start_every > 0
  )


def warm_start(
  config: TrainRunConfig,
  cases: Sequence[Case],
  host_suite: selfplay.Suite,
  state: TrainState,
  suite: selfplay.Suite,
  mesh: jax.sharding.Mesh,
  lead: bool,
) -> TrainState:
  """`state` after the imitation warm start (`train.imitate`) on the best-known plans of
  `cases` (`agents.imitation`); `host_suite` is this process's copy of the replicated `suite`."""
  known = suite_cmd.load_best_known(config.best_known).get("cases", {})
  problems = [selfplay.case_problem(c) for c in cases]
  plans = imitation.teacher_plans(
    problems,
    [plan_from_json(known[c.name]) if c.name in known else None for c in cases],
    host_suite,
    config.train.env,
  )
  flag = f"--imitation-updates {config.imitation_updates}"
  if not plans:
    raise ValueError(
      f"{flag}: the environment can choose the pipeline of none of the best-known plans"
    )
  teacher = imitation.teacher_samples(host_suite, config.train.env, plans)
  replayed = len(teacher.problem)
  climbed = ""
  if config.imitation_climbs:
    climbs, how_many = imitation.climb_samples(problems, host_suite, config.train.env)
    teacher = jax.tree.map(lambda *x: np.concatenate(x), teacher, climbs)
    climbed = f" and {len(climbs.problem)} from {how_many} climbs from the experts' plans"
  count = len(teacher.problem)
  if count > config.train.replay_capacity:
    raise ValueError(
      f"{flag}: {count} teacher samples do not fit --train.replay-capacity "
      f"{config.train.replay_capacity}"
    )
  teacher = train.replicate(teacher, mesh)
  imitate = train.imitate.lower(
    state, suite, teacher, config.train, mesh, config.imitation_updates
  ).compile()
  checkpoint.barrier(
    "compiled the warm start"
  )  # As for the iteration: compile times differ by more than gloo waits.
  state, metrics = imitate(state, suite, teacher)
  if lead:
    values = {k: float(v) for k, v in train.host_copy(metrics).items()}
    actions = sum(len(a) for _, a in plans)
    print(
      f"imitation: {replayed} samples ({replayed / actions:.0%} of the teachers' actions; the rest "
      "illegal there or "
      f"past the step limit) from the best-known plans of {len(plans)} of {len(cases)} "
      f"cases{climbed}, "
      f"{config.imitation_updates} updates: policy KL {values['policy_kl']:.4f}, "
      f"value loss {values['value_loss']:.5f}"
    )
  return state


def from_policy(state: TrainState, path: str) -> TrainState:
  """`state` with the parameters of the policy (or run) directory `path` in place of its
  own, restored onto their shardings (replicated over the run's mesh); its optimizer
  state, buffer and key unchanged."""
  return state.replace(params=checkpoint.load_params(path, state.params))


def run(config: TrainRunConfig) -> TrainResult:
  """Trains (see the module docstring); with several processes, one that fails in a
  collective waits for the watch to name the process lost (`experiments.distributed`)."""
  initialize(config.distributed)
  try:
    result = _train(config)
  except jax.errors.JaxRuntimeError as e:
    distributed.await_lost_peer(e)
    raise
  distributed.finish()
  return result


def _train(config: TrainRunConfig) -> TrainResult:
  config, fitted = fit_devices(config)
  _check_config(config)
  mesh = train.data_mesh(config.devices)
  train.check_mesh(config.train, mesh)
  _prepare_dir(config)
  lead = is_lead()
  if lead and fitted:
    print(fitted)
  cases, suite = build_suite(dataclasses.replace(config, progress=config.progress and lead))
  if lead:
    print(
      f"training on {len(cases)} {config.split} cases: {', '.join(c.name for c in cases)}; "
      f"{mesh.size} devices in {jax.process_count()} process(es)"
    )
  host_suite = suite
  state = train.replicate(
    train.init(config.train, suite), mesh
  )  # From this process's suite, then replicated.
  suite = train.replicate(suite, mesh)
  # Orbax's checkpoint manager meets the other processes in a collective (30 s of gloo):
  # processes that traced the suite at different speeds meet at a barrier first.
  checkpoint.barrier("built the suite")
  checkpoints = checkpoint.TrainCheckpoints(config.run_dir)
  done, state = checkpoints.restore_latest(state)
  policy = os.path.join(config.run_dir, checkpoint.POLICY_DIR)
  if done:
    # The policy of the checkpoint resumed: a run killed after its last save may have
    # left an older one.
    checkpoint.save_policy(policy, state.params, config.train.network)
    if lead:
      print(f"resumed {config.run_dir} at iteration {done}")
  else:
    if config.init_policy is not None:
      state = from_policy(state, config.init_policy)
      if lead:
        print(f"starting from the parameters of {checkpoint.policy_dir(config.init_policy)}")
    if config.imitation_updates:
      state = warm_start(config, cases, host_suite, state, suite, mesh, lead)
  rows = _read_metrics(config.run_dir, done)
  logger = wandb_run(config) if lead else None
  _log_wandb(logger, config.run_dir, rows, done)
  bar = tqdm(
    total=config.iterations,
    initial=done,
    desc="self-play",
    unit="it",
    disable=not (config.progress and lead),
    dynamic_ncols=True,
  )
  # Compiled before the processes meet, as compile times differ by more than gloo waits.
  step = train.iteration.lower(state, suite, config.train, mesh).compile()
  checkpoint.barrier("compiled the iteration")
  start = time.perf_counter()
  try:
    with preemption.Preemption() as preempt:
      for i in range(done, config.iterations):
        state, metrics = step(state, suite)
        values = {
          k: float(v) for k, v in train.host_copy(metrics).items()
        }  # Waits for the iteration.
        row = {"iteration": i + 1, "seconds": time.perf_counter() - start, **values}
        rows.append(row)
        if lead:
          _write_metrics(config.run_dir, rows)
        bar.update()
        bar.set_postfix_str(
          f"return {row['score']:+.3f} kl {row['policy_kl']:.3f} value {row['value_loss']:.4f}",
          refresh=False,
        )
        stop = preempt.reached(i + 1)
        if stop or (i + 1) % config.checkpoint_every == 0 or i + 1 == config.iterations:
          checkpoints.save(i + 1, state)
          checkpoint.save_policy(policy, state.params, config.train.network, i + 1)
          _log_wandb(logger, config.run_dir, rows, i + 1)
        if stop:
          bar.close()
          print(
            f"preempted: process {jax.process_index()} saved iteration {i + 1} in "
            f"{os.path.join(config.run_dir, checkpoint.CHECKPOINTS_DIR, str(i + 1))}; "
            "the same command resumes it"
          )
          break
  finally:
    bar.close()
    checkpoints.close()
    if logger is not None:
      logger.finish()
  if lead and config.learning_curve and rows:
    plot_curve(rows, os.path.join(config.run_dir, CURVE_FILE))
  if lead and rows:
    last = rows[-1]
    print(
      f"iteration {last['iteration']}: mean return {last['score']:+.4f} (plan / best expert "
      f"{last['ratio']:.4f}), policy KL {last['policy_kl']:.4f}, value loss "
      f"{last['value_loss']:.5f}; "
      f"run in {config.run_dir}"
    )
  return TrainResult(run_dir=config.run_dir, state=state, metrics=rows)
