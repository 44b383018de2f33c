"""Tests for automap_rl.mesh."""

import jax
import pytest

from automap_rl import mesh as mesh_lib


def test_parse_spec_keeps_order():
  assert mesh_lib.parse_mesh_spec("data=2, model=4") == {"data": 2, "model": 4}
  assert list(mesh_lib.parse_mesh_spec("b=1,a=3")) == ["b", "a"]


def test_make_mesh_from_string_and_mapping_agree():
  a = mesh_lib.make_mesh("data=2,model=4", "h100")
  b = mesh_lib.make_mesh({"data": 2, "model": 4}, mesh_lib.HARDWARE["h100"])
  assert a == b
  assert a.axis_names == ("data", "model")
  assert a.axis_sizes == (2, 4)
  assert a.num_devices == 8
  assert a.axis_size("model") == 4
  assert a.axis_index("data") == 0


def test_links_all_intra_node_within_one_h100_node():
  m = mesh_lib.make_mesh("data=2,model=4", "h100")
  nvlink = mesh_lib.HARDWARE["h100"].intra_node
  assert m.links == (nvlink, nvlink)
  assert m.link("data").name == "nvlink4"


def test_links_major_axis_crosses_h100_nodes():
  m = mesh_lib.make_mesh("data=4,model=8", "h100")
  assert m.link("model").name == "nvlink4"
  assert m.link("data").name == "infiniband-ndr"


def test_links_block_must_divide_node():
  # A block of 3 devices cannot tile a node of 8 without straddling it.
  m = mesh_lib.make_mesh("data=2,model=3", "h100")
  assert m.link("model").name == "infiniband-ndr"


@pytest.mark.parametrize(
  "spec, message",
  [
    ("data2", "'data2'"),
    ("data=2,,model=4", "''"),
    ("data=two", "'data=two'"),
    ("=4", "'=4'"),
    ("data=0", "'data' has size 0"),
    ("data=-1", "'data' has size -1"),
    ("data=2,data=4", "Duplicate axis name 'data'"),
    ("1x=2", "'1x'"),
  ],
)
def test_make_mesh_errors_name_the_bad_part(spec, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    mesh_lib.make_mesh(spec, "cpu")


def test_unknown_axis_and_hardware_errors():
  m = mesh_lib.make_mesh("data=2", "cpu")
  with pytest.raises(ValueError, match="no axis 'model'.*'data'"):
    m.axis_size("model")
  with pytest.raises(ValueError, match="'tpu-v9'.*'a100'.*'h100'"):
    mesh_lib.get_hardware("tpu-v9")


def test_hardware_profiles_are_complete():
  assert set(mesh_lib.HARDWARE) == {
    "h100",
    "h200",
    "a100",
    "a100-40g",
    "a100-80g",
    "tpu-v4",
    "tpu-v5e",
    "cpu",
  }
  for name, hw in mesh_lib.HARDWARE.items():
    assert hw.name == name
    assert set(hw.flops) == {"float32", "bfloat16", "float16", "int8"}
    assert min(hw.flops.values()) > 0
    assert hw.hbm_bytes > 0 and hw.hbm_bandwidth > 0
    assert hw.intra_node.bandwidth >= hw.inter_node.bandwidth > 0
    assert hw.devices_per_node >= 1


def test_to_jax_mesh():
  m = mesh_lib.make_mesh("data=2,model=4", "cpu")
  jm = mesh_lib.to_jax_mesh(m)
  assert jm.axis_names == ("data", "model")
  assert dict(jm.shape) == {"data": 2, "model": 4}
  assert all(t == jax.sharding.AxisType.Auto for t in jm.axis_types)
  assert [d.id for d in jm.devices.flat] == [d.id for d in jax.devices()[:8]]


def test_to_jax_mesh_too_few_devices():
  m = mesh_lib.make_mesh("data=4,model=8", "cpu")
  with pytest.raises(
    ValueError, match="needs 32 devices but only 8.*xla_force_host_platform_device_count"
  ):
    mesh_lib.to_jax_mesh(m)
