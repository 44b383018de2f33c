"""Numerics of a lowered plan: its outputs against the unpartitioned function's.

`check_numerics` runs the partitioned and the unpartitioned program and raises
`NumericsError` naming the first output leaf that differs beyond tolerance. Typed PRNG keys
(`jax.random.key`), integer and boolean leaves are never cast and must match exactly (keys
by their key data); float leaves are compared with a float64 run of the function, or, where
that cannot run (a model that fixes a dtype), with the unpartitioned run in its own dtype
under tolerances scaled by the program's depth (`compare_leaf`), and the report says which.
A program that computes in a narrower float than an output leaf (bfloat16 matmuls of
float32 parameters: each device rounds its partial gradient to bfloat16, one device the
whole sum) is allowed that dtype's rounding on what the step computed, and its noise is
sampled at that precision (`compute_dtype`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from automap_rl.compile_options import quick_compile_options
from automap_rl.ir import Program, updated_arguments

if TYPE_CHECKING:
  from automap_rl.xla.lower import Lowered

__all__ = [
  "NumericsError",
  "Reference",
  "check_numerics",
  "compare_outputs",
  "compute_dtype",
  "program_depth",
  "reference_outputs",
]


class NumericsError(AssertionError):
  """The partitioned program computes different numbers from the unpartitioned one."""


# (rtol, atol) by dtype: what reordering the sums of a small training step may cost.
TOLERANCES: dict[str, tuple[float, float]] = {
  "float64": (1e-9, 1e-12),
  "float32": (1e-4, 1e-6),
  "bfloat16": (2e-2, 1e-3),
  "float16": (1e-2, 1e-4),
}


def is_key(x: Any) -> bool:
  """Whether `x` is a typed PRNG key array (`jax.random.key`)."""
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def host_copy(x: Any) -> Any:
  """A host copy of an array leaf, keys included (as keys of the same implementation)."""
  if is_key(x):
    return jax.random.wrap_key_data(np.array(jax.random.key_data(x)), impl=jax.random.key_impl(x))
  return np.array(x)


def _comparable(x: Any) -> np.ndarray:
  """A leaf as a host array: keys by their key data (bits compare exactly)."""
  return np.asarray(jax.random.key_data(x) if is_key(x) else x)


def program_depth(program: Program) -> int:
  """The longest chain of dependent op executions from the arguments to an output: a loop
  body's ops count once per trip (`Op.repeat`), as they run unrolled."""
  depth = np.zeros(program.num_values, np.int64)
  for op in program.ops:
    start = max((int(depth[v]) for v in op.operands), default=0)
    for v in op.results:
      depth[v] = max(int(depth[v]), start + op.repeat)
  return int(max((depth[v] for v in program.outputs), default=0)) or 1


def compute_dtype(program: Program) -> str:
  """The narrowest floating dtype among the program's values (fewest mantissa bits;
  `float32` when it has none): the precision its partial sums may be rounded to (a
  partitioned bfloat16 matmul rounds each device's partial sum, one device the whole)."""
  floats = {
    v.dtype
    for v in program.values
    if not v.dtype.startswith("key") and jax.dtypes.issubdtype(v.dtype, np.floating)
  }
  return min(floats, key=lambda d: (_mantissa_bits(d), d), default="float32")


def _mantissa_bits(dtype: Any) -> int:
  return int(jnp.finfo(dtype).nmant)


def _matched_exactly(path: str, plain: np.ndarray, actual: np.ndarray) -> bool:
  """Whether leaf `path` is compared exactly (an integer, boolean or key leaf), and then
  matched; raises `NumericsError` on a shape or dtype mismatch or differing elements."""
  if plain.shape != actual.shape or plain.dtype != actual.dtype:
    raise NumericsError(
      f"Output {path}: expected {plain.dtype}{list(plain.shape)}, "
      f"got {actual.dtype}{list(actual.shape)}."
    )
  if np.issubdtype(plain.dtype, np.inexact):
    return False
  bad = plain != actual
  if bad.any():
    raise NumericsError(f"Output {path}: {int(bad.sum())} of {bad.size} elements differ.")
  return True


def compare_leaf(
  path: str,
  reference: np.ndarray | None,
  plain: np.ndarray,
  actual: np.ndarray,
  tolerances: Mapping[str, tuple[float, float]] = TOLERANCES,
  depth: int = 1,
  perturbed: Sequence[np.ndarray] = (),
  compute: str = "float32",
  before: np.ndarray | None = None,
) -> None:
  """Raises `NumericsError` naming `path` and the errors unless `actual` (partitioned)
  is about as close to `reference` (float64) as `plain` (unpartitioned, same dtype) is.

  Norm-wise, per leaf of n elements:
  `|actual - ref| <= rtol |ref| + atol sqrt(n) + 2 noise`, `noise` the largest of
  `|plain - ref|` and `|p - ref|` for each `p` of `perturbed` (the unpartitioned run on
  arguments moved by one unit in their last bit, each with its own random directions:
  samples of the rounding noise, as one can be lucky; on a ViT's key bias the norms of
  eight such samples spread over 0.26-0.55 of 1e-3). Elementwise bounds fail on a first AdamW step,
  whose update
  `g / (sqrt(g^2) + eps)` turns the rounding noise of a tiny gradient element into an
  O(lr) difference (a key bias under softmax has a gradient of zero in exact arithmetic:
  its whole update is noise); the float64 reference measures that noise, so the bound
  stays tight where the step is well conditioned.

  Without a float64 reference (`reference` None: the function cannot run in float64), the
  partitioned run is compared with the unpartitioned one in their own dtype; tolerances
  scale with `sqrt(depth)` (the program's op depth, `program_depth`: rounding errors of a
  chain of `depth` ops add up like a random walk), and the noise is measured by
  `perturbed`: `|actual - plain| <= sqrt(depth) (rtol |plain| + atol sqrt(n)) + 2 max_p |p -
  plain|`.

  Where `compute` (the dtype the program computes in, `compute_dtype`) is narrower than
  the leaf's, the step's change of the leaf, `|ref - before|` (`before`: the argument
  leaf it updates; None, a new value such as the loss: zero), is allowed `compute`'s
  rtol too: a bfloat16 gradient rounded per device moves an AdamW moment by a bfloat16
  unit, but a float32 parameter only by that unit of its update.

  Integer, boolean and key leaves (compared by their key data) must match exactly.
  """
  if _matched_exactly(path, plain, actual):
    return
  rtol, atol = tolerances.get(str(plain.dtype), tolerances["float32"])
  narrower = _mantissa_bits(compute) < _mantissa_bits(plain.dtype)
  rtol_compute = tolerances.get(compute, tolerances["float32"])[0] if narrower else 0.0
  change = lambda after: np.linalg.norm(after if before is None else after - before)
  if reference is None:
    base = plain.astype(np.float64)
    error = np.linalg.norm(actual.astype(np.float64) - base)
    noise = max([np.linalg.norm(p.astype(np.float64) - base) for p in perturbed], default=0.0)
    allowed = (
      np.sqrt(depth)
      * (rtol * np.linalg.norm(base) + rtol_compute * change(base) + atol * np.sqrt(base.size))
      + 2 * noise
    )
    if not error <= allowed:
      raise NumericsError(
        f"Output {path}: |partitioned - unpartitioned| = {error:.3g} exceeds {allowed:.3g} "
        f"(no float64 reference; {plain.dtype} tolerances scaled by sqrt(depth {depth}), "
        f"perturbed-input noise {noise:.3g})."
      )
    return
  ref = reference.astype(np.float64)
  error = actual.astype(np.float64) - ref
  noise = max([np.linalg.norm(plain - ref), *(np.linalg.norm(p - ref) for p in perturbed)])
  allowed = (
    rtol * np.linalg.norm(ref) + rtol_compute * change(ref) + atol * np.sqrt(ref.size) + 2 * noise
  )
  if not np.linalg.norm(error) <= allowed:
    raise NumericsError(
      f"Output {path}: |partitioned - float64 reference| = {np.linalg.norm(error):.3g} exceeds "
      f"{allowed:.3g} (unpartitioned: {noise:.3g}, |reference| {np.linalg.norm(ref):.3g}); max abs "
      f"error {np.max(np.abs(error), initial=0.0):.3g}."
    )


def _to_float64(tree: Any) -> Any:
  """Float leaves as float64 host arrays; keys, integers and booleans as they are."""
  return jax.tree.map(
    lambda x: (
      x
      if is_key(x)
      else np.asarray(x, np.float64)
      if np.issubdtype(x.dtype, np.floating)
      else np.asarray(x)
    ),
    tree,
  )


def _perturbed(tree: Any, seed: int, compute: str = "float32") -> Any:
  """Float leaves moved by one unit in the last place, up or down at random (`seed`), in
  their own dtype or, where `compute` is narrower, in `compute`'s (a float32 parameter
  that a bfloat16 model casts moves by one bfloat16 unit, or its cast would not move);
  keys, integers and booleans as they are."""
  rng = np.random.default_rng(seed)

  def nudge(x):
    if is_key(x) or not np.issubdtype(x.dtype, np.floating):
      return x
    x = np.asarray(x)
    down = rng.random(x.shape) < 0.5
    coarser = _mantissa_bits(x.dtype) - _mantissa_bits(compute)
    if coarser <= 0:
      return np.nextafter(x, np.where(down, -np.inf, np.inf).astype(x.dtype))
    step = np.spacing(np.abs(x)) * x.dtype.type(2.0**coarser)
    return np.where(down, x - step, x + step).astype(x.dtype)

  return jax.tree.map(nudge, tree)


# Perturbed runs of the unpartitioned step that sample its rounding noise (see `compare_leaf`).
NOISE_SAMPLES = 8


@dataclasses.dataclass(frozen=True)
class Reference:
  """What the partitioned program is compared with.

  Attributes:
    plain: host outputs of `jax.jit(fn)(*args)`, keys as key data.
    float64: host outputs of `fn` on float64 copies of the floating arguments under
      `jax.enable_x64`, or None where that run fails (a model fixing a dtype, such as
      `flax.linen.RNN`'s float32 carry).
    perturbed: host outputs of `jax.jit(fn)` on the arguments moved by one unit in the last
      place (of the dtype `fn` computes in, where narrower), `NOISE_SAMPLES` times with
      different directions (the noise floor of the comparison; the same compiled program,
      run again).
    note: `float64`, or `float32 (no float64 reference: <why>)`, for reports.
    compute: the narrowest float dtype `fn` computes in (`compute_dtype` of its program).
    before: per output leaf (flattened), a float64 host copy of the argument leaf it
      updates (`ir.updated_arguments`), or None (a new value, or not a float).
  """

  plain: Any
  float64: Any | None
  perturbed: tuple[Any, ...]
  note: str
  compute: str = "float32"
  before: tuple[np.ndarray | None, ...] = ()


def _updated_leaves(outputs: Any, args: Sequence[Any]) -> tuple[np.ndarray | None, ...]:
  """Per leaf of `outputs` (flattened), a float64 copy of the float argument leaf it
  updates, else None (see `Reference.before`)."""
  returned = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
  leaves = []
  for out, i in zip(returned, updated_arguments(returned, args)):
    old = [None] * len(jax.tree.leaves(out)) if i is None else jax.tree.leaves(args[i])
    leaves += [
      np.asarray(x, np.float64)
      if x is not None and not is_key(x) and np.issubdtype(x.dtype, np.floating)
      else None
      for x in old
    ]
  return tuple(leaves)


def reference_outputs(
  fn: Callable[..., Any], args: Sequence[Any], float64: bool = True, compute: str = "float32"
) -> Reference:
  """Runs `fn` unpartitioned, in its own dtypes and (unless `float64` is False) in float64;
  see `Reference`. `compute`: the narrowest float dtype `fn` computes in (`compute_dtype`
  of its program), the unit of the perturbed runs' moves. `args` are left untouched."""
  jitted = jax.jit(fn, compiler_options=quick_compile_options(jax.devices()[0].platform))
  run = lambda call_args: jax.tree.map(_comparable, jitted(*call_args))
  outputs = jitted(*args)
  plain, before = jax.tree.map(_comparable, outputs), _updated_leaves(outputs, args)
  perturbed = tuple(run(_perturbed(tuple(args), seed, compute)) for seed in range(NOISE_SAMPLES))
  why = "not asked for"
  if float64:
    try:
      with jax.enable_x64(True):
        return Reference(
          plain, run(_to_float64(tuple(args))), perturbed, "float64", compute, before
        )
    except Exception as e:  # Any failure of the float64 run: compare in float32, and say so.
      why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
  return Reference(
    plain, None, perturbed, f"float32 (no float64 reference: {why})", compute, before
  )


def compare_outputs(
  reference: Reference,
  actual: Any,
  depth: int,
  tolerances: Mapping[str, tuple[float, float]] = TOLERANCES,
) -> None:
  """Checks every leaf of the partitioned `actual` (see `compare_leaf`; `depth` scales the
  tolerances where there is no float64 reference); raises `NumericsError` naming the first
  leaf out of tolerance."""
  flat_plain, _ = jax.tree_util.tree_flatten_with_path(reference.plain)
  flat_actual = [_comparable(a) for a in jax.tree_util.tree_leaves(actual)]
  if len(flat_actual) != len(flat_plain):
    raise NumericsError(
      f"The partitioned program has {len(flat_actual)} outputs, the function {len(flat_plain)}."
    )
  leaves = lambda tree: (
    [None] * len(flat_plain) if tree is None else jax.tree_util.tree_leaves(tree)
  )
  flat_perturbed = zip(*(jax.tree_util.tree_leaves(p) for p in reference.perturbed))
  before = reference.before or (None,) * len(flat_plain)
  for (path, p), a, r, q, b in zip(
    flat_plain, flat_actual, leaves(reference.float64), flat_perturbed, before
  ):
    compare_leaf(
      jax.tree_util.keystr(path), r, np.asarray(p), a, tolerances, depth, q, reference.compute, b
    )


def check_numerics(
  fn: Callable[..., Any],
  args: Sequence[Any],
  lowered: Lowered,
  tolerances: Mapping[str, tuple[float, float]] = TOLERANCES,
  reference: Reference | None = None,
) -> Reference:
  """Runs the unpartitioned `fn`, a float64 reference and the partitioned program on
  `args` (concrete arrays, left untouched: the partitioned run copies them, so donation
  is harmless) and compares every output leaf; raises `NumericsError` on a mismatch.
  `reference`: `reference_outputs(fn, args)` if already run. Returns the reference
  compared with (its `note` says whether it was float64)."""
  reference = (
    reference_outputs(fn, args, compute=lowered.compute_dtype) if reference is None else reference
  )
  compare_outputs(reference, lowered.run(args), lowered.depth, tolerances)
  return reference
