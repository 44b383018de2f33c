"""Tests for automap_rl.xla.hlo: HLO text parsing and real CPU compiles."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from automap_rl.xla import hlo

NAMES, SIZES = ("data", "model"), (2, 4)


# ---------------------------------------------------------------- shapes ----


def test_parse_shapes_and_bytes():
  assert hlo.parse_shapes("f32[8,128]{1,0}") == (("f32", (8, 128)),)
  assert hlo.parse_shapes("(f32[4]{0}, bf16[2,8]{1,0})") == (
    ("f32", (4,)),
    ("bf16", (2, 8)),
  )
  assert hlo.parse_shapes("f32[]") == (("f32", ()),)
  assert hlo.parse_shapes("(s32[<=8]{0}, token[])") == (("s32", (8,)),)
  assert hlo.shape_bytes("(f32[4]{0}, bf16[2,8]{1,0})") == 16 + 32
  assert hlo.shape_bytes("(pred[3], c128[2], u16[5], f8e4m3fn[7])") == (3 + 32 + 10 + 7)


def test_unknown_element_type_is_named():
  with pytest.raises(ValueError, match="'q7'"):
    hlo.shape_bytes("q7[4]")


def test_parse_instruction():
  inst = hlo.parse_instruction(
    "  ROOT %all-to-all = (f32[16,64]{1,0}, f32[16,64]{1,0}) all-to-all("
    "%a, %b.1), channel_id=1, replica_groups={{0,1},{2,3}}"
  )
  assert inst.name == "all-to-all"
  assert inst.type == "(f32[16,64]{1,0}, f32[16,64]{1,0})"
  assert inst.opcode == "all-to-all"
  assert inst.operands == ("a", "b.1")
  assert inst.attrs.startswith(", channel_id=1")
  # Older HLO text prints operand types inline.
  inst = hlo.parse_instruction("%x = f32[4]{0} add(f32[4]{0} %p, f32[4]{0} %q)")
  assert inst.operands == ("p", "q")
  assert hlo.parse_instruction("ENTRY %main (p: f32[4]) -> f32[4] {") is None
  assert hlo.parse_instruction("}") is None


# ---------------------------------------------------------------- groups ----


def test_sharding_spec_maps_tiles_to_mesh_axes():
  spec = lambda text, rank=2: hlo.sharding_spec(text, rank, NAMES, SIZES)
  # Device order [2,4]T(1,0): the tile dim of 4 varies along `model`.
  assert spec("{devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}") == ((), ("model",))
  assert spec("{devices=[2,1,4]<=[8] last_tile_dim_replicate}") == (("data",), ())
  assert spec("{devices=[2,4]<=[8]}") == (("data",), ("model",))
  assert spec("{devices=[8,1]<=[2,4]T(1,0)}") == (("model", "data"), ())
  assert spec("{devices=[2,1,4]0,2,1,3,4,5,6,7 last_tile_dims={replicated}}") == (("data",), ())
  assert spec("{replicated}", 3) == ((), (), ())
  assert spec("{maximal device=0}") is None
  assert (
    spec("{devices=[2,1,4]0,4,1,5,2,6,3,7 last_tile_dim_replicate}") is None
  )  # Not a mesh axis.
  text = (
    ", sharding={{replicated}, {devices=[2,1,4]<=[8] last_tile_dim_replicate}}, "
    'metadata={op_name="x"}'
  )
  assert hlo.split_tuple_sharding(hlo.sharding_attr(text)) == (
    "{replicated}",
    "{devices=[2,1,4]<=[8] last_tile_dim_replicate}",
  )
  assert hlo.sharding_attr(", metadata={}") is None


def test_parse_explicit_groups():
  assert hlo.parse_explicit_groups("{{0,1},{2,3}}") == ((0, 1), (2, 3))
  assert hlo.parse_explicit_groups("{}") == ()
  with pytest.raises(ValueError, match=re.escape("'{{0,1}'")):
    hlo.parse_explicit_groups("{{0,1}")


def test_parse_iota_groups():
  assert hlo.parse_iota_groups("[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert hlo.parse_iota_groups("[4,2]<=[2,4]T(1,0)") == (
    (0, 4),
    (1, 5),
    (2, 6),
    (3, 7),
  )
  assert hlo.parse_iota_groups("[4,2]<=[2,2,2]T(0,2,1)") == (
    (0, 2),
    (1, 3),
    (4, 6),
    (5, 7),
  )
  with pytest.raises(ValueError, match="product 8"):
    hlo.parse_iota_groups("[3,2]<=[8]")


def test_parse_mesh_groups():
  assert hlo.parse_mesh_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}") == (
    (0, 1, 2, 3),
    (4, 5, 6, 7),
  )
  assert hlo.parse_mesh_groups("mesh[x=2,y=4] {x}") == (
    (0, 4),
    (1, 5),
    (2, 6),
    (3, 7),
  )
  # Device ids [4,2]T(1,0) place devices [[0,2],[4,6],[1,3],[5,7]].
  text = "mesh['a'=4,'b'=2], device_ids=([4,2]T(1,0)) {'b'}"
  assert hlo.parse_mesh_groups(text) == ((0, 2), (4, 6), (1, 3), (5, 7))
  text = "mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'a'}"
  assert hlo.parse_mesh_groups(text) == ((3, 1), (2, 0))
  # Sub-axes: 'x':(1)2 is the major half of x=4, 'x':(2)2 the minor half.
  assert hlo.parse_mesh_groups("mesh['x'=4] {'x':(1)2}") == ((0, 2), (1, 3))
  assert hlo.parse_mesh_groups("mesh['x'=4] {'x':(2)2}") == ((0, 1), (2, 3))
  with pytest.raises(ValueError, match="'z'"):
    hlo.parse_mesh_groups("mesh['x'=4] {'z'}")


def test_parse_replica_groups_dispatches_on_format():
  assert hlo.parse_replica_groups(", replica_groups={{0,1}}, x=1") == ((0, 1),)
  assert hlo.parse_replica_groups(", replica_groups={}, to_apply=%a") == ()
  assert hlo.parse_replica_groups(", replica_groups=[1,2]<=[2], x") == ((0, 1),)
  assert hlo.parse_replica_groups(", replica_groups=mesh['a'=2] {'a'}, dimensions={0}") == ((0, 1),)
  assert hlo.parse_replica_groups(", channel_id=1") is None


def test_permute_groups_are_connected_components():
  ring = [(0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 4)]
  assert hlo.permute_groups(ring) == ((0, 1, 2, 3), (4, 5))
  assert hlo.permute_groups([(0, 0), (2, 1)]) == ((0,), (1, 2))


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_a_permute_crosses_the_axes_its_pairs_move_along(sizes, data):
  """Pairs that shift devices along some axes (a ring step on each, the others fixed)
  cross exactly those axes, whichever devices take part."""
  names = tuple(f"a{i}" for i in range(len(sizes)))
  moved = data.draw(st.sets(st.sampled_from(range(len(sizes)))))
  devices = data.draw(st.lists(st.integers(0, math.prod(sizes) - 1), min_size=1, unique=True))
  pairs = []
  for device in devices:
    coords = list(np.unravel_index(device, sizes))
    target = [(c + 1) % n if i in moved else c for i, (c, n) in enumerate(zip(coords, sizes))]
    pairs.append((device, int(np.ravel_multi_index(target, sizes))))
  assert hlo.crossed_axes(pairs, names, sizes) == tuple(
    names[i] for i in sorted(moved) if sizes[i] > 1
  )


def test_group_mode_and_device_groups():
  assert hlo.group_mode("all-reduce", ", replica_groups={}") == "cross_replica"
  assert (
    hlo.group_mode("all-gather-start", ", channel_id=1, use_global_device_ids=true")
    == "flattened_id"
  )
  assert hlo.group_mode("all-reduce", ", channel_id=1") == "cross_replica_and_partition"
  assert hlo.group_mode("all-to-all", ", channel_id=1") == "cross_partition"
  # 2 replicas x 2 partitions; flattened id = replica * 2 + partition.
  assert hlo.device_groups((), "flattened_id", 2, 2) == ((0, 1, 2, 3),)
  assert hlo.device_groups(((0, 1),), "cross_partition", 2, 2) == (
    (0, 1),
    (2, 3),
  )
  assert hlo.device_groups(((0, 1),), "cross_replica", 2, 2) == ((0, 2), (1, 3))
  assert hlo.device_groups(((0,),), "cross_replica_and_partition", 1, 4) == ((0, 1, 2, 3),)


@pytest.mark.parametrize(
  "groups, expected",
  [
    ([[0, 1, 2, 3], [4, 5, 6, 7]], ("model",)),
    ([[3, 2, 1, 0], [7, 6, 5, 4]], ("model",)),  # Order is irrelevant.
    ([[0, 4], [1, 5], [2, 6], [3, 7]], ("data",)),
    ([range(8)], ("data", "model")),
    ([[i] for i in range(8)], ()),
    ([[0, 1], [2, 3], [4, 5], [6, 7]], None),  # Half of 'model'.
    ([[0, 1, 2, 3]], None),  # Does not cover the mesh.
  ],
)
def test_axes_for_groups(groups, expected):
  assert hlo.axes_for_groups(groups, NAMES, SIZES) == expected


def test_axes_for_groups_skips_size_one_axes():
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert hlo.axes_for_groups(groups, ("a", "b", "c"), (2, 1, 4)) == ("c",)


# ------------------------------------------------------ hand-written HLO ----

_ASYNC_HLO = """\
HloModule m, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%rs_body (p: bf16[64,32]) -> bf16[16,32] {
  %p = bf16[64,32]{1,0} parameter(0)
  ROOT %rs = bf16[16,32]{1,0} reduce-scatter(%p), channel_id=4, replica_groups=[2,4]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[16,8], b: f32[4], c: bf16[64,32]) -> f32[64,8] {
  %a = f32[16,8]{1,0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %c = bf16[64,32]{1,0} parameter(2)
  %ags = (f32[16,8]{1,0}, f32[64,8]{1,0}) all-gather-start(%a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %agd = f32[64,8]{1,0} all-gather-done(%ags)
  %ars = (f32[16,8]{1,0}, f32[4]{0}) all-reduce-start(%a, %b), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ard = (f32[16,8]{1,0}, f32[4]{0}) all-reduce-done(%ars)
  %cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%b), channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
  %cpd = f32[4]{0} collective-permute-done(%cps)
  %rss = ((bf16[64,32]{1,0}), bf16[16,32]{1,0}, s32[]) async-start(%c), calls=%rs_body
  %rsd = bf16[16,32]{1,0} async-done(%rss), calls=%rs_body
  ROOT %out = f32[64,8]{1,0} copy(%agd)
}
"""


def test_async_forms_are_counted_once():
  collectives = hlo.collectives_from_hlo(_ASYNC_HLO, NAMES, SIZES)
  assert [c.kind for c in collectives] == [
    "reduce-scatter",
    "all-gather",
    "all-reduce",
    "collective-permute",
  ]
  rs, ag, ar, cp = collectives
  assert (rs.bytes, rs.dtype, rs.shape, rs.mesh_axes) == (
    64 * 32 * 2,
    "bf16",
    (64, 32),
    ("model",),
  )
  assert (ag.bytes, ag.shape, ag.group_size, ag.num_groups, ag.mesh_axes) == (
    64 * 8 * 4,
    (64, 8),
    4,
    2,
    ("model",),
  )
  # Combined all-reduce: bytes summed over the tuple.
  assert (ar.bytes, ar.shape, ar.mesh_axes) == (
    16 * 8 * 4 + 4 * 4,
    ((16, 8), (4,)),
    ("data",),
  )
  # Pairs {0, 1}, {2, 3}, ...: no axis's groups, but every hop is along `model`.
  assert (cp.bytes, cp.group_size, cp.num_groups, cp.mesh_axes) == (
    16,
    2,
    4,
    ("model",),
  )
  assert hlo.summarize(collectives) == {
    "reduce-scatter": (1, 4096),
    "all-gather": (1, 2048),
    "all-reduce": (1, 528),
    "collective-permute": (1, 16),
  }


# ------------------------------------------------------ real CPU compiles ----


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() >= 8, "tests/conftest.py sets 8 CPU devices"
  return jax.make_mesh(SIZES, NAMES, axis_types=(AxisType.Auto,) * 2)


def _arg(mesh, shape, spec, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def test_contracting_dim_sharding_gives_one_all_reduce(mesh):
  x = _arg(mesh, (128, 256), P("data", "model"))
  w = _arg(mesh, (256, 64), P("model", None))
  stats = hlo.inspect_compiled(jax.jit(lambda x, w: x @ w).lower(x, w).compile(), NAMES, SIZES)
  # Each device holds a partial [64, 64] f32 product, summed over 'model'.
  assert stats.collectives == (
    hlo.Collective(
      kind="all-reduce",
      bytes=64 * 64 * 4,
      group_size=4,
      num_groups=2,
      mesh_axes=("model",),
      dtype="f32",
      shape=(64, 64),
      op_name="dot_general",  # The jaxpr op XLA's metadata names.
    ),
  )
  assert stats.flops > 0
  assert stats.argument_bytes == (64 * 64 + 64 * 64) * 4
  assert stats.output_bytes == 64 * 64 * 4
  assert stats.peak_bytes == (
    stats.argument_bytes + stats.output_bytes + stats.temp_bytes - stats.alias_bytes
  )


def test_resharding_to_replicated_gives_all_gather(mesh):
  x = _arg(mesh, (128, 256), P(None, "model"))
  f = lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P()))
  (ag,) = hlo.inspect_compiled(jax.jit(f).lower(x).compile(), NAMES, SIZES).collectives
  assert (ag.kind, ag.bytes, ag.mesh_axes, ag.group_size, ag.num_groups) == (
    "all-gather",
    128 * 256 * 4,
    ("model",),
    4,
    2,
  )


def test_psum_scatter_gives_reduce_scatter(mesh):
  f = jax.shard_map(
    lambda x: jax.lax.psum_scatter(x, "model", scatter_dimension=1, tiled=True),
    mesh=mesh,
    in_specs=P("data", None),
    out_specs=P("data", "model"),
  )
  x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
  (rs,) = hlo.inspect_compiled(jax.jit(f).lower(x).compile(), NAMES, SIZES).collectives
  # Operand is the per-device [64, 256] block; the result is a quarter of it.
  assert (rs.kind, rs.bytes, rs.mesh_axes, rs.shape) == (
    "reduce-scatter",
    64 * 256 * 4,
    ("model",),
    (64, 256),
  )


def test_all_to_all_and_ppermute(mesh):
  spec = P("data", "model")
  x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
  a2a = jax.shard_map(
    lambda x: jax.lax.all_to_all(x, "data", 0, 1, tiled=True),
    mesh=mesh,
    in_specs=spec,
    out_specs=spec,
  )
  ring = jax.shard_map(
    lambda x: jax.lax.ppermute(x, "model", [(i, (i + 1) % 4) for i in range(4)]),
    mesh=mesh,
    in_specs=spec,
    out_specs=spec,
  )
  (c,) = hlo.inspect_compiled(jax.jit(a2a).lower(x).compile(), NAMES, SIZES).collectives
  assert (c.kind, c.bytes, c.mesh_axes) == ("all-to-all", 64 * 64 * 4, ("data",))
  (c,) = hlo.inspect_compiled(jax.jit(ring).lower(x).compile(), NAMES, SIZES).collectives
  assert (c.kind, c.bytes, c.mesh_axes) == ("collective-permute", 64 * 64 * 4, ("model",))


def test_data_parallel_step_all_reduces_every_gradient(mesh):
  def loss(params, x):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"]) ** 2)

  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  params = {"w1": _arg(mesh, (256, 512), P()), "w2": _arg(mesh, (512, 64), P())}
  x = _arg(mesh, (128, 256), P(("data", "model"), None))
  stats = hlo.inspect_compiled(jax.jit(step).lower(params, x).compile(), NAMES, SIZES)
  assert {c.kind for c in stats.collectives} == {"all-reduce"}
  assert {c.mesh_axes for c in stats.collectives} == {("data", "model")}
  assert hlo.summarize(stats.collectives)["all-reduce"][1] == ((256 * 512 + 512 * 64) * 4)


def test_parse_instruction_drops_index_comments():
  line = (
    "%tuple.9 = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}) tuple(%a, %b, "
    "%c, "
    '%d, %e, /*index=5*/%f), metadata={op_name="x"}'
  )
  inst = hlo.parse_instruction(line)
  assert inst.operands == ("a", "b", "c", "d", "e", "f")
  assert inst.opcode == "tuple"


_SLICED_STACK = """HloModule m

%fused (p0: f32[24,8,4], p1: s32[], p2: f32[24,8,4]) -> (f32[4,8], f32[8,4]) {
  %p0 = f32[24,8,4]{2,1,0} parameter(0)
  %t = f32[24,4,8]{2,1,0} transpose(%p0), dimensions={0,2,1}
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,4,8]{2,1,0} dynamic-slice(%t, %p1, %z, %z), dynamic_slice_sizes={1,4,8}
  %b = f32[4,8]{1,0} bitcast(%ds)
  %p2 = f32[24,8,4]{2,1,0} parameter(2)
  %n = f32[24,8,4]{2,1,0} negate(%p2)
  %s = f32[1,8,4]{2,1,0} slice(%n), slice={[3:4], [0:8], [0:4]}
  %c = f32[8,4]{1,0} bitcast(%s)
  ROOT %r = (f32[4,8]{1,0}, f32[8,4]{1,0}) tuple(%b, %c)
}

ENTRY %main (a: f32[24,8,4], i: s32[], w: f32[24,8,4]) -> (f32[4,8], f32[8,4]) {
  %a = f32[24,8,4]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %w = f32[24,8,4]{2,1,0} parameter(2)
  ROOT %f = (f32[4,8]{1,0}, f32[8,4]{1,0}) fusion(%a, %i, %w), kind=kLoop, calls=%fused
}
"""


def test_a_fusion_counts_the_slices_it_reads_of_a_transposed_or_computed_operand():
  """A loop body's fusion slicing one layer out of a stacked buffer through a transpose
  (or elementwise ops) reads that layer, as `HloCostAnalysis` counts it, not the stack."""
  module = hlo.parse_module(_SLICED_STACK)
  fusion = module.bodies["main"][-1]
  layer = 8 * 4 * 4
  assert hlo.instruction_bytes(fusion, module.types, module.bodies) == 2 * layer + 4 + 2 * layer


_LOOPED_KERNELS = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_dot (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  %d = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %n = f32[8,4]{1,0} negate(%d)
}

%body (state: (f32[8,16], f32[16,4], f32[8,4])) -> (f32[8,16], f32[16,4], f32[8,4]) {
  %state = (f32[8,16]{1,0}, f32[16,4]{1,0}, f32[8,4]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%state), index=0
  %w = f32[16,4]{1,0} get-tuple-element(%state), index=1
  %f = f32[8,4]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %r = f32[8,4]{1,0} all-reduce(%f), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (f32[8,16]{1,0}, f32[16,4]{1,0}, f32[8,4]{1,0}) tuple(%x, %w, %r)
}

%cond (state: (f32[8,16], f32[16,4], f32[8,4])) -> pred[] {
  %state = (f32[8,16]{1,0}, f32[16,4]{1,0}, f32[8,4]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[8,16], b: f32[16,4], c: f32[8,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %c = f32[8,4]{1,0} parameter(2)
  %init = (f32[8,16]{1,0}, f32[16,4]{1,0}, f32[8,4]{1,0}) tuple(%a, %b, %c)
  %loop = (f32[8,16]{1,0}, f32[16,4]{1,0}, f32[8,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[8,4]{1,0} get-tuple-element(%loop), index=2
  ROOT %copy = f32[8,4]{1,0} copy(%out)
}
"""


def test_an_unfused_slice_reads_what_it_keeps_and_an_update_writes_in_place():
  """As `HloCostAnalysis` counts them: a dynamic slice of one layer out of a stack of 24
  reads that layer, and a dynamic-update-slice of one layer into it reads and writes
  the layer, not the stack."""
  module = hlo.parse_module("""ENTRY %main (a: f32[24,8,4], i: s32[], u: f32[1,8,4]) -> f32[24,8,4] {
  %a = f32[24,8,4]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %u = f32[1,8,4]{2,1,0} parameter(2)
  %z = s32[] constant(0)
  %ds = f32[1,8,4]{2,1,0} dynamic-slice(%a, %i, %z, %z), dynamic_slice_sizes={1,8,4}
  ROOT %dus = f32[24,8,4]{2,1,0} dynamic-update-slice(%a, %u, %i, %z, %z)
}
""")
  ds, dus = module.bodies["main"][-2:]
  layer = 8 * 4 * 4
  assert hlo.instruction_bytes(ds, module.types, module.bodies) == layer + 3 * 4 + layer
  assert hlo.instruction_bytes(dus, module.types, module.bodies) == layer + 3 * 4 + layer


def test_kernels_are_the_fusions_and_unfused_instructions_per_step():
  """A loop of 3 runs its dot fusion 3 times (its flops those of its fused dot and
  negate, its bytes its operands and result); the all-reduce, the loop and the tuples
  are no kernels; the entry's copy runs once."""
  module = hlo.parse_module(_LOOPED_KERNELS)
  fusion_flops = 2 * 8 * 4 * 16 + 8 * 4
  fusion_bytes = 4 * (8 * 16 + 16 * 4 + 8 * 4)
  assert hlo.kernel_costs(module) == ((3 * fusion_flops, 3 * fusion_bytes), (0.0, 2 * 4 * 8 * 4))


def test_loop_iterations_are_counted(mesh):
  """A scanned layer stack holds each instruction once; its flops equal those of the
  unrolled twin, and its collectives run once per layer: per-step bytes grow linearly
  with the depth while the module's text stays the same."""

  def loss(ws, x, unroll):
    def layer(x, w):
      return jnp.tanh(x @ w) * 0.5 + x, None

    return jax.lax.scan(layer, x, ws, unroll=unroll)[0].sum()

  def stats(layers, unroll):
    ws = _arg(mesh, (layers, 64, 64), P(None, None, "model"))
    x = _arg(mesh, (32, 64), P("data", None))
    # Gradients of both arguments: the unrolled module cannot drop the first layer's.
    compiled = (
      jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2).lower(ws, x, unroll).compile()
    )
    return hlo.inspect_compiled(compiled, NAMES, SIZES)

  scanned = {layers: stats(layers, 1) for layers in (2, 4, 6)}
  unrolled = stats(4, 4)
  assert scanned[4].flops == pytest.approx(unrolled.flops, rel=0.02)
  # Bytes: the scanned module keeps loop-carried copies the unrolled one does not, so
  # only their growth is checked: linear in the depth, as every buffer's size is.
  growth = [scanned[b].bytes_accessed - scanned[a].bytes_accessed for a, b in ((2, 4), (4, 6))]
  assert growth[0] == pytest.approx(growth[1], rel=1e-3) and growth[0] > 0
  assert max(c.repeat for c in scanned[6].collectives) == 6
  # Every flop is in a kernel, the looped ones counted once per iteration, but for the
  # all-reduces' additions, which XLA counts too (2% of this small model's flops).
  for s in (*scanned.values(), unrolled):
    assert s.flops * 0.975 < sum(flops for flops, _ in s.kernels) <= s.flops
  once = lambda s: sum(c.bytes for c in s.collectives)
  per_step = lambda s: sum(c.repeat * c.bytes for c in s.collectives)
  assert once(scanned[2]) == once(scanned[4]) == once(scanned[6])
  assert (
    per_step(scanned[6]) - per_step(scanned[4]) == per_step(scanned[4]) - per_step(scanned[2]) > 0
  )
