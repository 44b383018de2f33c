"""The costs of a strategy graph's nodes: each site strategy's seconds and bytes from
`simulator.terms`, the live-bytes pieces of its memory nodes, and the problem whose costs
are all local to nodes and edges (`local_costs`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import simulator
from automap_rl.problem import Problem
from automap_rl.sharding import Resolution
from automap_rl.solver import Limits
from automap_rl.strategy_graph.graph import Site

_CHUNK = 256  # Plans per jitted resolve / terms call (one compile per problem).


def site_terms(
  problem: Problem, sites: Sequence[Site], limits: Limits
) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Each site's strategy costs (seconds, summed over its signatures) and usages (bytes:
  gathered operands of an op site; for a value site, the shard count its memory nodes
  divide by), [n] each."""
  cost = {id(site): np.zeros(site.num_strategies) for site in sites}
  usage = {id(site): np.zeros(site.num_strategies) for site in sites}
  _op_site_terms(problem, sites, cost, usage, limits)
  _value_site_terms(problem, sites, cost, usage, limits)
  return [cost[id(s)] for s in sites], [usage[id(s)] for s in sites]


def _private_tables(
  tables: simulator.CostTables, combos: Sequence[int]
) -> tuple[simulator.CostTables, dict[int, int]]:
  """`tables` where every edge has a private value signature and every combination of
  partial sums (`combos`, op signatures) a private copy of its source op, so that one
  batch of resolutions sets each op signature's masks independently of the others'; and
  each combination's copy, an op signature past the last."""
  num_ops, num_edges = len(tables.op_compute_s), len(tables.edge_op)
  copy_of = {o: num_ops + j for j, o in enumerate(combos)}
  sources = [int(tables.op_reduction_source[o]) for o in combos]
  source = np.concatenate([np.arange(num_ops), np.arange(num_ops, num_ops + len(combos))]).astype(
    np.int32
  )
  source[combos] = [copy_of[o] for o in combos]
  private = tables.replace(
    value_bytes=tables.value_bytes[tables.edge_value],
    value_compute_s=np.zeros(num_edges, np.float32),
    value_memory_s=np.zeros(num_edges, np.float32),
    value_launch_s=np.zeros(num_edges, np.float32),
    edge_value=np.arange(num_edges, dtype=np.int32),
    value_dim_class=tables.value_dim_class[tables.edge_value],
    value_count=tables.value_count[tables.edge_value],
    live_bytes=np.zeros((1, num_edges), np.float32),
    op_compute_s=np.concatenate([tables.op_compute_s, np.zeros(len(combos), np.float32)]),
    op_launch_s=np.concatenate([tables.op_launch_s, np.zeros(len(combos), np.float32)]),
    op_reduction=np.concatenate([tables.op_reduction, tables.op_reduction[sources]]),
    op_reduction_source=source,
    op_deferred=np.concatenate([tables.op_deferred, np.zeros(len(combos), bool)]),
    op_dense_factor=np.concatenate([tables.op_dense_factor, np.full(len(combos), -1, np.int32)]),
    op_dot_reduction=np.concatenate(
      [tables.op_dot_reduction, np.full(len(combos), len(tables.reduction_edge), np.int32)]
    ),
  )
  return private, copy_of


def _op_site_terms(
  problem: Problem,
  sites: Sequence[Site],
  cost: dict[int, np.ndarray],
  usage: dict[int, np.ndarray],
  limits: Limits,
) -> None:
  """Adds each op site's strategy costs (its compute and its edges' collectives) and
  usages (its gathered operand copies) to `cost` and `usage` (by site id)."""
  tables = problem.tables
  op_sites = [(site, o) for site in sites if site.kind == "op" for o in site.indices]
  num_ops, num_edges = len(tables.op_compute_s), len(tables.edge_op)
  combos = [o for _, o in op_sites if int(tables.op_reduction_source[o]) != o]
  private, copy_of = _private_tables(tables, combos)
  rf, rv = problem.sigs.op_class.shape[1], problem.sigs.value_class.shape[1]
  edges_of = [np.flatnonzero(tables.edge_op == o) for o in range(num_ops)]

  def op_masks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    op_mask = np.zeros((len(rows), num_ops + len(combos), rf), np.int32)
    value_mask = np.zeros((len(rows), num_edges, rv), np.int32)
    for site, o in op_sites:
      pick = site.masks[np.minimum(rows, site.num_strategies - 1)]  # [B, L]
      edges = edges_of[o]
      op_mask[:, o] = pick[:, :rf]
      value_mask[:, edges] = pick[:, rf : rf + rv * len(edges)].reshape(len(rows), len(edges), rv)
      if o in copy_of:
        op_mask[:, copy_of[o]] = pick[:, rf + rv * len(edges) :]
    return value_mask, op_mask

  batch = max([site.num_strategies for site, _ in op_sites] + [1])
  for rows, terms in _terms_batches(private, op_masks, batch, limits):
    edge_seconds = terms.gather.seconds + terms.all_to_all.seconds + terms.permute.seconds  # [B, E]
    reduction_seconds = (
      terms.reduce_scatter.seconds + terms.all_reduce.seconds + terms.dot_permute.seconds
    )  # [B, R]
    per_op = terms.op_compute_s[:, :num_ops].astype(np.float64)
    np.add.at(per_op.T, tables.edge_op, edge_seconds.T)
    np.add.at(per_op.T, tables.edge_op[tables.reduction_edge], reduction_seconds.T)
    gathered = np.zeros((len(rows), num_ops))
    np.add.at(gathered.T, tables.edge_op, (terms.gathered_bytes + terms.transient_bytes).T)
    for site, o in op_sites:
      mine = rows < site.num_strategies
      cost[id(site)][rows[mine]] += per_op[mine, o]
      usage[id(site)][rows[mine]] += gathered[mine, o]


def _value_site_terms(
  problem: Problem,
  sites: Sequence[Site],
  cost: dict[int, np.ndarray],
  usage: dict[int, np.ndarray],
  limits: Limits,
) -> None:
  """Adds each value site's strategy costs (the compute of the ops that follow its values)
  to `cost` and sets its usages to its values' shard counts (by site id)."""
  tables = problem.tables
  value_sites = [(site, v) for site in sites if site.kind == "value" for v in site.indices]
  num_ops = len(tables.op_compute_s)
  rf, rv = problem.sigs.op_class.shape[1], problem.sigs.value_class.shape[1]

  def value_masks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    value_mask = np.zeros((len(rows), len(tables.value_bytes), rv), np.int32)
    for site, v in value_sites:
      value_mask[:, v] = site.masks[np.minimum(rows, site.num_strategies - 1)]
    return value_mask, np.zeros((len(rows), num_ops, rf), np.int32)

  value_shards = {}
  batch = max([site.num_strategies for site, _ in value_sites] + [1])
  for rows, terms in _terms_batches(tables, value_masks, batch, limits):
    for site, v in value_sites:
      mine = rows < site.num_strategies
      cost[id(site)][rows[mine]] += terms.value_compute_s[mine, v]
      value_shards.setdefault(v, np.zeros(site.num_strategies))[rows[mine]] = terms.value_shards[
        mine, v
      ]
  for site in sites:
    if site.kind == "value":  # Alike rows: every signature of the site has the same shards.
      usage[id(site)] = value_shards[site.indices[0]]


def _terms_batches(tables: simulator.CostTables, masks, batch: int, limits: Limits):
  """Yields (rows, `simulator.terms`) of plans 0..batch-1 in chunks, `masks(rows)` giving
  each chunk's value and op masks [B, ...]; terms as numpy [B, ...]."""
  fn = jax.jit(jax.vmap(lambda v, o: simulator.terms(tables, Resolution(value_mask=v, op_mask=o))))
  for start in range(0, batch, _CHUNK):
    limits.check("costing the strategy graph's sites")
    rows = np.arange(start, min(start + _CHUNK, batch))
    value_mask, op_mask = masks(np.arange(start, start + _CHUNK))
    terms = jax.device_get(fn(jnp.asarray(value_mask), jnp.asarray(op_mask)))
    yield rows, jax.tree.map(lambda x: np.asarray(x)[: len(rows)], terms)


def live_pieces(profile: np.ndarray) -> list[tuple[int, int, float]]:
  """A non-negative profile [T] as constant pieces `(start, end, amount)` whose sum at every
  t in [start, end) is `profile[t]`: at most 2T pieces (a stack of open layers)."""
  pieces, stack = [], []  # Stack of (start, top level of the layer).
  for t, level in enumerate([*profile.tolist(), 0.0]):
    while stack and stack[-1][1] > level:
      start, top = stack.pop()
      below = stack[-1][1] if stack else 0.0
      pieces.append((start, t, top - max(below, level)))
      if below < level:
        stack.append((start, level))
    if level > (stack[-1][1] if stack else 0.0):
      stack.append((t, level))
  return pieces


def local_costs(problem: Problem) -> Problem:
  """`problem` with every cost local to a node or an edge of a graph, whose costs are
  sums of per-node and per-edge terms, so the graph is built on it; the plan cost the
  graph gives is exactly this problem's. Four costs of `problem` are not local:
  reductions combined by XLA's combiners (`CostTables.reduction_combines`), here each
  paying its own latency (an upper bound: combining only merges latencies); and reads
  of one value priced as sharing one resharding that resolve apart under a plan
  (`CostTables.shared_slot_edge`), here each paying its static share (a lower bound:
  those only add); and collectives hidden behind compute (`CostTables.async_collectives`),
  here none hidden (an upper bound); and the order the lowering lays a dim's mesh axes out
  in, which counts the values of its named dimension split over each axis
  (`CostTables.value_count`), here mesh order."""
  tables = dataclasses.replace(
    problem.tables,
    async_collectives=np.array(False),
    value_count=np.zeros_like(problem.tables.value_count),
    reduction_combines=np.zeros_like(problem.tables.reduction_combines),
    shared_slot_runs=np.zeros_like(problem.tables.shared_slot_runs),
  )
  return Problem(problem.program, problem.named, problem.mesh, problem.sigs, tables)
