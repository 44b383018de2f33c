"""AlphaZero-style training of the policy/value network by self-play over a suite of problems.

One `iteration` is a pure, jitted function of the training state: B episodes of Gumbel
MuZero self-play from the current network (`agents.selfplay.play`; episode b of
iteration i plays suite problem `(i * B + b) mod P`, so every problem is visited in turn,
from its replicated plan or, every `expert_start_every` sweeps, from its best expert plan),
their samples into the replay buffer (`agents.replay`), then `updates` optax steps on
minibatches drawn from it. The loss is the cross-entropy of the network's policy to the
search's improved policy plus `value_weight` times the squared error of its value to the
episode's log-return to come (`agents.selfplay`); gradients are clipped by global norm.

Everything random comes from the state's key, and the state (parameters, optimizer
state, replay buffer, key, iteration) is one pytree: the same seed gives the same
parameters, and a run restored from a checkpoint of its state continues exactly as an
uninterrupted one (the learning rate depends only on the update count, never on the
length of the run).

Devices. An iteration runs on a 1-D mesh whose one axis, `data`, spans every device of
every process (`data_mesh`); the state and the suite are replicated over it
(`replicate`). Self-play splits the B episodes over it with `shard_map`: each device plays
its B / n alone, with no communication (each episode has its own keys, so the episodes do
not depend on the device count), and one all-gather gives every device all of them for
the replicated buffer. Each update draws the same B samples on every device; each device
takes the gradient on its B / n of them, encoding its share of the suite's programs
(`encode_suite`), and one all-reduce averages them. Collectives
move one flat buffer each (`agents.packed`): between processes they cost milliseconds per
operand. The parameters depend on the device count only through the order in which the
all-reduce sums the per-device gradients (float reassociation, about 1e-7 relative).
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agents import packed, replay, selfplay
from agents.gumbel import GumbelConfig, GumbelSettings
from agents.network import Embeddings, Network, NetworkConfig, state_features, static_graph
from agents.selfplay import Samples, Suite
from envs import EnvConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Self-play training.

  Attributes:
    seed: seeds the parameters and every random choice of the run.
    episodes: B, episodes played side by side per iteration.
    episode_length: L, steps per episode (the environment truncates there).
    gumbel: self-play's Gumbel searches (`agents.gumbel.GumbelSettings`; its noise is
      the exploration of self-play).
    max_decisions: the environment's capacity in class decisions.
    max_axes: mesh axes the tables are laid out for (at least the suite's largest mesh).
    action_space: the environment's action space.
    memory_penalty: the environment's penalty factor on memory overflow.
    replay_capacity: samples the replay buffer holds.
    batch_size: samples per optimizer step.
    updates: optimizer steps per iteration.
    learning_rate: Adam's learning rate after warm-up.
    warmup_updates: optimizer steps of linear learning-rate warm-up.
    weight_decay: AdamW's decoupled weight decay.
    max_grad_norm: gradients are clipped to this global norm.
    value_weight: weight of the value loss beside the policy loss.
    network: the network's sizes, and the pipeline options self-play's environment offers
      (`NetworkConfig.pipelines`).
    expert_start_every: every this many sweeps over the suite, the last one starts its
      episodes from each problem's best expert plan (`agents.selfplay.expert_start`), the
      others from the replicated plan; 0: always from the replicated plan.
  """

  seed: int = 0
  episodes: int = 8
  episode_length: int = 12
  gumbel: GumbelSettings = GumbelSettings()
  max_decisions: int = 256
  max_axes: int = 3
  action_space: str = "groups"
  memory_penalty: float = 1.0
  replay_capacity: int = 4096
  batch_size: int = 64
  updates: int = 8
  learning_rate: float = 1e-3
  warmup_updates: int = 50
  weight_decay: float = 1e-4
  max_grad_norm: float = 1.0
  value_weight: float = 1.0
  network: NetworkConfig = NetworkConfig(pipelines=5)
  expert_start_every: int = 0

  @property
  def env(self) -> EnvConfig:
    """The environment self-play runs (truncated at `episode_length` steps)."""
    return EnvConfig(
      action_space=self.action_space,
      max_decisions=self.max_decisions,
      max_axes=self.max_axes,
      objective="time",
      memory_penalty=self.memory_penalty,
      max_steps=self.episode_length,
      pipelines=self.network.pipelines,
    )

  @property
  def search(self) -> GumbelConfig:
    """The search self-play runs."""
    return GumbelConfig(
      action_space=self.action_space,
      max_decisions=self.max_decisions,
      gumbel=self.gumbel,
      network=self.network,
      pipelines=self.network.pipelines,
    )


@chex.dataclass(frozen=True)
class TrainState:
  """Everything a run carries from one iteration to the next (a pytree; checkpointed whole).

  Attributes:
    params: the network's parameters.
    opt_state: the optimizer's state.
    buffer: the replay buffer of `Samples`.
    key: the run's random key as raw key data (`jax.random.key_data`), uint32 [2].
    iteration: iterations done, int32 [].
  """

  params: chex.ArrayTree
  opt_state: chex.ArrayTree
  buffer: replay.Buffer
  key: jax.Array
  iteration: jax.Array


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """AdamW after global-norm clipping, with linear warm-up to a constant learning rate."""
  schedule = optax.linear_schedule(0.0, config.learning_rate, max(config.warmup_updates, 1))
  return optax.chain(
    optax.clip_by_global_norm(config.max_grad_norm),
    optax.adamw(schedule, weight_decay=config.weight_decay),
  )


def _example(suite: Suite) -> Samples:
  """One sample shaped as the suite's programs give them (for the buffer's layout)."""
  root = jax.tree.map(lambda x: x[0], suite.roots)
  tables = jax.tree.map(lambda x: x[0], suite.tables)
  return Samples(
    problem=jnp.int32(0),
    features=state_features(tables, root),
    policy=jnp.zeros(tables.num_actions, jnp.float32),
    value=jnp.float32(0.0),
  )


DATA_AXIS = "data"


def data_mesh(devices: int | None = None) -> Mesh:
  """The 1-D `data` mesh training shards its episodes and minibatches over: every device
  of every process (None), or `devices` of them, as many from each process (its first
  local ones).

  Raises:
    ValueError: `devices` is not a positive multiple of the process count, or more than
      the processes have.
  """
  processes = jax.process_count()
  if devices is None:
    return Mesh(np.asarray(jax.devices()), (DATA_AXIS,))
  have = jax.device_count()
  if devices < 1 or devices % processes or devices > have:
    raise ValueError(
      f"--devices {devices}: give a multiple of the {processes} process(es), at most the {have} "
      "devices they have."
    )
  per_process = devices // processes
  chosen = [
    d
    for p in range(processes)
    for d in [d for d in jax.devices() if d.process_index == p][:per_process]
  ]
  return Mesh(np.asarray(chosen), (DATA_AXIS,))


def check_mesh(config: TrainConfig, mesh: Mesh) -> None:
  """Refuses episodes or minibatches that the mesh's `data` axis does not divide.

  Raises:
    ValueError: naming the field and the device count.
  """
  n = mesh.shape[DATA_AXIS]
  for name, value in (("episodes", config.episodes), ("batch-size", config.batch_size)):
    if value % n:
      raise ValueError(
        f"--train.{name} {value} does not split over the {n} devices of the data axis; "
        f"give a multiple of {n} (or fewer --devices)."
      )


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array."""
  return NamedSharding(mesh, PartitionSpec())


def replicate(tree: chex.ArrayTree, mesh: Mesh) -> chex.ArrayTree:
  """`tree` as global arrays replicated over `mesh`, built from this process's copy (every
  process must hold the same values: a suite built, or a state initialised, from the same
  config)."""
  host = jax.device_get(tree)
  return jax.tree.map(
    lambda x: jax.make_array_from_callback(np.shape(x), replicated(mesh), lambda index: x[index]),
    host,
  )


def host_copy(tree: chex.ArrayTree) -> chex.ArrayTree:
  """The values of replicated global arrays as numpy arrays, read from this process's
  devices (`jax.device_get` refuses arrays that span other processes)."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


@functools.partial(jax.jit, static_argnames="config")
def init(config: TrainConfig, suite: Suite) -> TrainState:
  """The state before the first iteration: fresh parameters from `config.seed`, an empty
  buffer. Pure (jitted)."""
  key, init_key = jax.random.split(jax.random.key(config.seed))
  tables = jax.tree.map(lambda x: x[0], suite.tables)
  root = jax.tree.map(lambda x: x[0], suite.roots)
  params = Network(config.network).init(init_key, tables, root)
  return TrainState(
    params=params,
    opt_state=optimizer(config).init(params),
    buffer=replay.empty(_example(suite), config.replay_capacity),
    key=jax.random.key_data(key),
    iteration=jnp.int32(0),
  )


def encode_suite(
  params: chex.ArrayTree, suite: Suite, config: TrainConfig, devices: int
) -> Embeddings:
  """The embeddings of the suite's P programs, leaves [P, ...]. With `devices` = n > 1 it
  runs inside `shard_map` over the `data` axis: each device encodes its ceil(P / n)
  programs (the last repeated to fill the share) and one all-gather gives every device all
  of them, so the encoder's work, the larger part of an update, is split over the devices
  too; its gradient comes back in one reduce-scatter."""
  network = Network(config.network)
  encode = jax.vmap(network.encode, in_axes=(None, 0))
  graphs = jax.vmap(static_graph)(suite.tables, suite.roots)
  if devices == 1:
    return encode(params, graphs)
  share = -(-suite.size // devices)
  mine = jnp.minimum(jax.lax.axis_index(DATA_AXIS) * share + jnp.arange(share), suite.size - 1)
  embeddings = packed.all_gather_rows(
    encode(params, jax.tree.map(lambda x: x[mine], graphs)), DATA_AXIS
  )
  return jax.tree.map(lambda x: x[: suite.size], embeddings)


def loss(
  params: chex.ArrayTree, suite: Suite, batch: Samples, config: TrainConfig, devices: int = 1
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The training loss on a batch [n] and its parts. The suite's P programs are encoded
  once (`encode_suite`, split over `devices`); each sample's head reads its program's
  embeddings."""
  network = Network(config.network)
  mine = jax.tree.map(lambda x: x[batch.problem], encode_suite(params, suite, config, devices))
  logits, value = jax.vmap(network.head, in_axes=(None, 0, 0))(params, mine, batch.features)
  chex.assert_equal_shape([logits, batch.policy])
  log_q = jax.nn.log_softmax(logits)
  log_p = jnp.log(jnp.where(batch.policy > 0, batch.policy, 1.0))
  policy_loss = -(batch.policy * log_q).sum(axis=-1).mean()
  # Summed term by term, not as the cross-entropy less the entropy (both about 4 where the
  # KL is about 0.2): its float error then scales with the KL, not with the cross-entropy.
  policy_kl = (batch.policy * (log_p - log_q)).sum(axis=-1).mean()
  value_loss = 0.5 * jnp.square(value - batch.value).mean()
  total = policy_loss + config.value_weight * value_loss
  return total, {
    "loss": total,
    "policy_loss": policy_loss,
    "policy_kl": policy_kl,
    "value_loss": value_loss,
  }


@functools.partial(jax.jit, static_argnames=("config", "mesh"))
def self_play(
  params: chex.ArrayTree,
  suite: Suite,
  problems: jax.Array,
  from_expert: jax.Array,
  key: chex.PRNGKey,
  config: TrainConfig,
  mesh: Mesh,
) -> selfplay.Episodes:
  """An iteration's episodes (`agents.selfplay.play` of `problems`, int32 [B], from their
  expert starts where `from_expert`, bool [B]), split over
  the mesh's `data` axis: each device plays its B / n episodes alone (`shard_map`: its
  search loops stop when its own episodes are done, with no collective to ask the others),
  then one all-gather of them all (`agents.packed`) leaves every device every episode.
  Pure (jitted; its operations are named `jit(self_play)/...` in a compiled iteration)."""
  keys = selfplay.episode_keys(key, config.episode_length, problems.shape[0])

  def play(params, suite, problems, from_expert, keys) -> selfplay.Episodes:
    mine = selfplay.play(params, suite, problems, from_expert, keys, config.search, config.env)
    batch_axes = selfplay.Episodes(
      samples=jax.tree.map(lambda _: 1, mine.samples), active=1, final=0, steps=0
    )
    return packed.all_gather(mine, DATA_AXIS, batch_axes)

  split = PartitionSpec(DATA_AXIS)
  return jax.shard_map(
    play,
    mesh=mesh,
    in_specs=(PartitionSpec(), PartitionSpec(), split, split, PartitionSpec(None, DATA_AXIS)),
    out_specs=PartitionSpec(),
    check_vma=False,
  )(params, suite, problems, from_expert, keys)  # mctx's loops start from constants.


def _update(config: TrainConfig, suite: Suite, mesh: Mesh, carry, key: chex.PRNGKey):
  """One optimizer step on a minibatch of the buffer: each device the loss's gradient on its
  B / n of the B samples drawn, their mean over the devices in one all-reduce (`agents.packed`)."""
  params, opt_state, buffer = carry
  devices = mesh.shape[DATA_AXIS]

  def gradients(params, suite, buffer, key):
    part = config.batch_size // devices
    batch = replay.sample(
      buffer, key, config.batch_size, jax.lax.axis_index(DATA_AXIS) * part, part
    )
    return packed.pmean(
      jax.grad(loss, has_aux=True)(params, suite, batch, config, devices), DATA_AXIS
    )

  # Unchecked: with checked replication jax would sum the replicated parameters' gradients
  # itself, leaf by leaf.
  grads, parts = jax.shard_map(
    gradients, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False
  )(params, suite, buffer, key)
  updates, opt_state = optimizer(config).update(grads, opt_state, params)
  parts["grad_norm"] = optax.tree.norm(grads)
  return (optax.apply_updates(params, updates), opt_state, buffer), parts


@functools.partial(jax.jit, static_argnames=("config", "mesh", "updates"))
def imitate(
  state: TrainState, suite: Suite, teacher: Samples, config: TrainConfig, mesh: Mesh, updates: int
) -> tuple[TrainState, dict[str, jax.Array]]:
  """The warm start: the teacher samples (`agents.imitation.teacher_samples`, leaves [N, ...],
  replicated over `mesh`) into the replay buffer, then `updates` optimizer steps on the
  buffer (as an iteration's updates), before any self-play. Self-play's samples later
  overwrite the teacher's, oldest first. Pure (jitted).

  Returns:
    The state (same iteration count) and the mean losses of the last tenth of its steps.
  """
  n = jax.tree.leaves(teacher)[0].shape[0]
  key = jax.random.wrap_key_data(state.key)
  key, update_key = jax.random.split(key)
  buffer = replay.add(state.buffer, teacher, jnp.ones(n, bool))
  (params, opt_state, buffer), parts = jax.lax.scan(
    functools.partial(_update, config, suite, mesh),
    (state.params, state.opt_state, buffer),
    jax.random.split(update_key, updates),
  )
  tail = max(updates // 10, 1)
  metrics = {name: value[-tail:].mean() for name, value in parts.items()}
  new = TrainState(
    params=params,
    opt_state=opt_state,
    buffer=buffer,
    key=jax.random.key_data(key),
    iteration=state.iteration,
  )
  return jax.lax.with_sharding_constraint((new, metrics), replicated(mesh))


def episode_starts(
  config: TrainConfig, iteration: jax.Array, size: int
) -> tuple[jax.Array, jax.Array]:
  """Where iteration `iteration`'s B episodes start on a suite of `size` problems: episode b
  is the run's episode `iteration * B + b`, which plays problem `(iteration * B + b) mod P`,
  from its expert start in every `expert_start_every`-th sweep over the suite.

  Returns:
    The problems, int32 [B], and whether each starts from its expert start, bool [B].
  """
  played = iteration * config.episodes + jnp.arange(config.episodes, dtype=jnp.int32)
  every = config.expert_start_every
  from_expert = (played // size % every == every - 1) if every else jnp.zeros(config.episodes, bool)
  return played % size, from_expert


@functools.partial(jax.jit, static_argnames=("config", "mesh"))
def iteration(
  state: TrainState, suite: Suite, config: TrainConfig, mesh: Mesh
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One iteration (see the module docstring) on `mesh` (`data_mesh`; `check_mesh` must
  accept it), `state` and `suite` replicated over it. Pure (jitted).

  Returns:
    The next state and the iteration's metrics (f32 scalars): `score` (mean return
    `log(best expert / final plan)` of its episodes), `ratio` (mean final plan cost over
    the best expert's), `beats_expert` (share of episodes whose plan beats every expert),
    `steps` (mean episode length), the mean losses of its updates, `buffer` (samples held).
  """
  key = jax.random.wrap_key_data(state.key)
  key, play_key, update_key = jax.random.split(key, 3)
  problems, from_expert = episode_starts(config, state.iteration, suite.size)
  episodes = self_play(state.params, suite, problems, from_expert, play_key, config, mesh)
  # [episodes, steps, ...] -> [episodes * steps, ...] (sizes spelled out: a field may be empty, e.g.
  # no options).
  flat = jax.tree.map(
    lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), episodes.samples
  )
  buffer = replay.add(state.buffer, flat, episodes.active.reshape(-1))
  (params, opt_state, buffer), parts = jax.lax.scan(
    functools.partial(_update, config, suite, mesh),
    (state.params, state.opt_state, buffer),
    jax.random.split(update_key, config.updates),
  )
  returns = selfplay.score(suite, problems, episodes.final)
  metrics = {name: value.mean() for name, value in parts.items()}
  metrics.update(
    score=returns.mean(),
    ratio=jnp.exp(-returns).mean(),
    beats_expert=(returns > 1e-6).mean(),
    steps=episodes.steps.mean(dtype=jnp.float32),
    buffer=buffer.size.astype(jnp.float32),
  )
  new = TrainState(
    params=params,
    opt_state=opt_state,
    buffer=buffer,
    key=jax.random.key_data(key),
    iteration=state.iteration + 1,
  )
  return jax.lax.with_sharding_constraint((new, metrics), replicated(mesh))
