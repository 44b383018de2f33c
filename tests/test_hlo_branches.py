"""Tests for automap_rl.xla.hlo's conditionals: each branch counted as often as the
iterations of a loop that take it run it (a pipeline's tick switch), and the largest
branch that `cost_analysis()` counts instead corrected."""

import jax
import jax.numpy as jnp
import pytest

from automap_rl.xla import hlo
from automap_rl.xla.hlo.cost import analysis_counts

# A loop of 3 iterations whose body runs one of two branches: `heavy` (a dot, 1024 flops,
# then an all-reduce and a conditional of its own between `square` and `double`, 32 flops
# each) or `light` (a negate, 32 flops).
_SWITCHED = """HloModule m, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%square (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %m = f32[8,4]{1,0} multiply(%p, %p)
}

%double (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %a = f32[8,4]{1,0} add(%p, %p)
}

%heavy (s: (f32[8,16], f32[16,4], s32[])) -> f32[8,4] {
  %s = (f32[8,16]{1,0}, f32[16,4]{1,0}, s32[]) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%s), index=0
  %w = f32[16,4]{1,0} get-tuple-element(%s), index=1
  %j = s32[] get-tuple-element(%s), index=2
  %d = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r = f32[8,4]{1,0} all-reduce(%d), replica_groups={{0,1}}, to_apply=%add
  ROOT %c = f32[8,4]{1,0} conditional(%j, %r, %r), branch_computations={%square, %double}
}

%light (s: (f32[8,16], f32[16,4], s32[])) -> f32[8,4] {
  %s = (f32[8,16]{1,0}, f32[16,4]{1,0}, s32[]) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%s), index=0
  %k = f32[8,4]{1,0} slice(%x), slice={[0:8], [0:4]}
  ROOT %n = f32[8,4]{1,0} negate(%k)
}

%body (state: (f32[8,16], f32[16,4], s32[], s32[])) -> (f32[8,16], f32[16,4], s32[], s32[]) {
  %state = (f32[8,16]{1,0}, f32[16,4]{1,0}, s32[], s32[]) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%state), index=0
  %w = f32[16,4]{1,0} get-tuple-element(%state), index=1
  %i = s32[] get-tuple-element(%state), index=2
  %j = s32[] get-tuple-element(%state), index=3
  %o = (f32[8,16]{1,0}, f32[16,4]{1,0}, s32[]) tuple(%x, %w, %j)
  %y = f32[8,4]{1,0} conditional(%i, %o, %o), branch_computations={%heavy, %light}
  ROOT %t = (f32[8,16]{1,0}, f32[16,4]{1,0}, s32[], s32[]) tuple(%x, %w, %i, %j)
}

%cond (state: (f32[8,16], f32[16,4], s32[], s32[])) -> pred[] {
  %state = (f32[8,16]{1,0}, f32[16,4]{1,0}, s32[], s32[]) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[8,16], b: f32[16,4], i: s32[], j: s32[]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %j = s32[] parameter(3)
  %init = (f32[8,16]{1,0}, f32[16,4]{1,0}, s32[], s32[]) tuple(%a, %b, %i, %j)
  %loop = (f32[8,16], f32[16,4], s32[], s32[]) while(%init), condition=%cond, body=%body, TRIPS
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=0
}
""".replace("TRIPS", 'backend_config={"known_trip_count":{"n":"3"}}')
# Iteration 0 runs `heavy` and in it `double`, iteration 1 `light`, iteration 2 `heavy`
# and in it `square`.
_TAKEN = ({(): 0, (0,): 1}, {(): 1}, {(): 0, (0,): 0})
_DOT, _SMALL = 2 * 8 * 4 * 16, 8 * 4


def test_a_branch_runs_in_the_iterations_that_take_it():
  every = hlo.parse_module(_SWITCHED)
  assert [every.repeats[c] for c in ("body", "heavy", "light", "square", "double")] == [3] * 5
  module = hlo.parse_module(_SWITCHED, _TAKEN)
  assert [module.repeats[c] for c in ("body", "heavy", "light", "square", "double")] == [
    3,
    2,
    1,
    1,
    1,
  ]
  (reduce,) = hlo.module_collectives(module, ("x",), (2,))
  assert reduce.repeat == 2
  # A branch no iteration takes runs never; its collectives with it.
  never = hlo.parse_module(_SWITCHED, ({(): 1},) * 3)
  assert never.repeats["heavy"] == never.repeats["square"] == 0
  assert [c.repeat for c in hlo.module_collectives(never, ("x",), (2,))] == [0]


def test_cost_analysis_counts_the_largest_branch_once_and_the_rest_is_corrected():
  """`cost_analysis()` counts the loop body once and of each conditional the branch
  with the most flops (`heavy`, and in it the first of its equal branches): the
  correction brings the flops to what the iterations run, the taken branches' flops."""
  module = hlo.parse_module(_SWITCHED, _TAKEN)
  own = {
    name: sum(hlo.instruction_flops(i, module.types) for i in body)
    for name, body in module.bodies.items()
  }
  counted = analysis_counts(module, own)
  assert [counted[c] for c in ("body", "heavy", "light", "square", "double")] == [1, 1, 0, 1, 0]
  analysed = _DOT + _SMALL  # What `cost_analysis()` gives.
  runs = 2 * _DOT + 3 * _SMALL  # heavy twice, light once, square once, double once.
  assert analysed + hlo.uncounted_cost(module)[0] == runs
  every = hlo.parse_module(_SWITCHED)
  assert analysed + hlo.uncounted_cost(every)[0] == 3 * (_DOT + 3 * _SMALL)


def test_a_taken_branch_the_conditional_does_not_have_is_named():
  with pytest.raises(ValueError, match=r"has 2 branches; the taken branches name 2") as e:
    hlo.parse_module(_SWITCHED, ({(): 2},) * 3)
  assert "\n" not in str(e.value)


def test_a_compiled_switch_counts_what_each_device_group_runs():
  """A scan of 4 ticks that switches between a matmul, a tanh (no flops: XLA counts it
  apart) and a scaling: the flops are those of the branches each group of devices
  takes (`taken`), the busiest group's, not every branch in every tick."""
  n = 64

  def ticks(x, w, kinds):
    branches = [lambda x: x @ w, jnp.tanh, lambda x: x * 2.0]
    return jax.lax.scan(lambda x, k: (jax.lax.switch(k, branches, x), None), x, kinds)[0]

  x = jax.ShapeDtypeStruct((n, n), jnp.float32)
  kinds = jax.ShapeDtypeStruct((4,), jnp.int32)
  compiled = jax.jit(ticks).lower(x, x, kinds).compile()
  dot, scale = 2 * n**3, n * n
  row = lambda table: [{(): k} for k in table]
  every = hlo.inspect_compiled(compiled, (), ())
  assert every.flops == pytest.approx(4 * (dot + scale), rel=0.01)
  one = hlo.inspect_compiled(compiled, (), (), [row([0, 1, 1, 2])])
  assert one.flops == pytest.approx(dot + scale, rel=0.01)
  busiest = hlo.inspect_compiled(compiled, (), (), [row([0, 1, 1, 2]), row([0, 0, 2, 1])])
  assert busiest.flops == pytest.approx(2 * dot + scale, rel=0.01)
  assert sum(f for f, _ in busiest.kernels) == pytest.approx(2 * dot + scale, rel=0.01)
  assert busiest.peak_bytes == every.peak_bytes  # One figure for the SPMD module.
