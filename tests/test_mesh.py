"""Tests for automap_rl.mesh and automap_rl.topology."""

import dataclasses

import jax
import numpy as np
import pytest

from automap_rl import mesh as mesh_lib
from automap_rl import topology


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


def _split(m, axis):
  link = m.link(axis)
  return link.ici, link.dcn


def test_links_all_intra_node_within_one_h100_node():
  m = mesh_lib.make_mesh("data=2,model=4", "h100")
  nvlink = mesh_lib.HARDWARE["h100"].intra_node
  assert [(link.name, link.bandwidth, link.latency) for link in m.links] == [
    (nvlink.name, nvlink.bandwidth, nvlink.latency)
  ] * 2
  assert (_split(m, "data"), _split(m, "model")) == ((2, 1), (4, 1))


def test_links_major_axis_crosses_h100_nodes():
  m = mesh_lib.make_mesh("data=4,model=8", "h100")
  assert m.link("model").name == "nvlink4"
  assert m.link("data").name == "infiniband-ndr"
  assert m.link("data").bandwidth == mesh_lib.HARDWARE["h100"].inter_node.bandwidth


def test_a100_model_on_nvlink_data_on_network():
  m = mesh_lib.make_mesh("data=32,model=8", "a100-80g")
  assert (m.link("model").name, _split(m, "model")) == ("nvlink3", (8, 1))
  assert (m.link("data").name, _split(m, "data")) == ("infiniband-hdr", (1, 32))


def test_axis_partly_in_a_node_gets_a_link_between_the_two():
  # 64 H100s: model (4) and half of data fill a node of 8; data spans 2 nodes.
  m = mesh_lib.make_mesh("stage=4,data=4,model=4", "h100")
  hw = mesh_lib.HARDWARE["h100"]
  assert _split(m, "model") == (4, 1) and _split(m, "stage") == (1, 4)
  data = m.link("data")
  assert (data.ici, data.dcn, data.name) == (2, 2, "nvlink4+infiniband-ndr")
  assert hw.inter_node.bandwidth < data.bandwidth < hw.intra_node.bandwidth
  assert hw.intra_node.latency < data.latency < hw.inter_node.latency


def test_mesh_inside_one_node_is_all_ici_whatever_its_sizes():
  # 6 devices fit one node of 8, though a block of 3 does not divide 8.
  m = mesh_lib.make_mesh("data=2,model=3", "h100")
  assert {link.name for link in m.links} == {"nvlink4"}


def test_axis_of_12_inside_a_tpu_v4_pod_is_ici():
  m = mesh_lib.make_mesh("data=16,model=12", "tpu-v4")
  ici = mesh_lib.HARDWARE["tpu-v4"].intra_node
  assert _split(m, "model") == (12, 1) and _split(m, "data") == (16, 1)
  # 192 chips: 12 x (4 x 4), whole cubes, a torus: model a wrapped ring over one dimension
  # (both directions), data over two (four links).
  assert m.link("model").bandwidth == pytest.approx(2 * ici.bandwidth)
  assert m.link("data").bandwidth == pytest.approx(4 * ici.bandwidth)
  assert m.link("model").name == "ici x2"


@pytest.mark.parametrize(
  "spec, hardware, links",
  [
    ("data=64", "tpu-v4", {"data": 6}),  # One 4x4x4 cube: three wrapped dimensions.
    ("data=64,model=16", "tpu-v4", {"data": 4, "model": 2}),
    ("data=16,model=16", "tpu-v5e", {"data": 2, "model": 2}),  # The whole 16x16 pod.
    # 16 v4 chips are no whole cube: a mesh without wraparound, one link per dimension.
    ("data=4,model=4", "tpu-v4", {"data": 1, "model": 2}),
    ("data=4,model=4", "tpu-v5e", {"data": 1, "model": 1}),
    # Three axes on a 2-D torus: the major one shares a dimension.
    ("data=2,fsdp=2,model=8", "tpu-v5e", {"data": 1, "fsdp": 1, "model": 1}),
    ("data=16,model=8", "h100", {"data": 1, "model": 1}),  # Switched: no torus.
  ],
)
def test_torus_axes_use_the_links_they_have(spec, hardware, links):
  m = mesh_lib.make_mesh(spec, hardware)
  one = mesh_lib.HARDWARE[hardware].intra_node.bandwidth
  assert {a: m.link(a).ici_links for a in m.axis_names} == links
  for a, k in links.items():
    if m.link(a).dcn == 1:
      assert m.link(a).bandwidth == pytest.approx(k * one)


def test_tpu_mesh_beyond_a_pod_crosses_the_dcn():
  m = mesh_lib.make_mesh("data=32,model=16", "tpu-v5e")  # 512 chips, 2 pods of 256.
  assert _split(m, "model") == (16, 1) and _split(m, "data") == (16, 2)
  assert m.link("data").name == "ici x2+dcn"


def test_effective_link_matches_the_two_level_collective():
  ici_link, dcn_link = topology.Link("i", 300e9, 2e-6), topology.Link("d", 25e9, 9e-6)
  for ici, dcn in [(2, 2), (8, 4), (3, 5), (1, 6), (4, 1)]:
    a, buffer = ici * dcn, 3.0e8
    bandwidth, latency = topology.hierarchical_link(ici, ici_link, dcn, dcn_link)
    ring = (a - 1) / a * buffer / bandwidth + (a - 1) * latency
    # All-gather across nodes of the B/a shard, then within the node of B/ici.
    across = (dcn - 1) * (buffer / a / dcn_link.bandwidth + dcn_link.latency)
    within = (ici - 1) * (buffer / ici / ici_link.bandwidth + ici_link.latency)
    assert ring == pytest.approx(across + within, rel=1e-12)


def test_stated_splits():
  m = mesh_lib.make_mesh("data=2x4,model=2", "h100")
  assert m.axis_sizes == (8, 2)
  assert _split(m, "data") == (4, 2) and _split(m, "model") == (2, 1)
  assert m.link("data").stated and m.link("model").stated
  same = mesh_lib.make_mesh({"data": 8, "model": 2}, "h100", dcn={"data": 2})
  assert same == m
  assert mesh_lib.parse_mesh_spec("data=2x4,model=2") == {"data": 8, "model": 2}
  # Stated all-ICI on a TPU pod: as inferred, but marked stated.
  v4 = mesh_lib.make_mesh("data=1x16,model=1x12", "tpu-v4")
  assert (
    v4.link("model").bandwidth
    == mesh_lib.make_mesh("data=16,model=12", "tpu-v4").link("model").bandwidth
  )


@pytest.mark.parametrize(
  "spec, dcn, message",
  [
    (
      "data=1x16,model=8",
      None,
      "ICI parts data 16 x model 8 put 128 devices in one node, but a node of h100 has 8",
    ),
    ("data=2x8,model=8", None, "put 64 devices in one node"),
    ("data=16,model=8", {"data": 3}, "axis 'data' of 16 devices cannot have a DCN part of 3"),
    ("data=16,model=8", {"batch": 2}, "dcn names axes \\['batch'\\]"),
    ("data=0x4", None, "'data' has size 0"),
    ("data=-2x-4", None, "'data' has DCN part -2"),
    ("data=8", {"data": 2.0}, "'data' has DCN part 2.0"),
    ("data=2x4,model=2", {"data": 2}, "axes \\['data'\\] split in both spec and dcn"),
    ("data=2x", None, "'data=2x'"),
    (
      "data=4,model=3",
      None,
      "axis 'data' \\(4 devices 3 apart\\) straddles the 8-device nodes of h100",
    ),
  ],
)
def test_bad_splits_are_one_line_errors(spec, dcn, message):
  with pytest.raises(ValueError, match=message) as info:
    mesh_lib.make_mesh(spec, "h100", dcn=dcn)
  assert "\n" not in str(info.value)


def test_device_grid_is_row_major_when_inferred_and_hybrid_when_stated():
  inferred = mesh_lib.make_mesh("stage=4,data=4,model=4", "h100")
  assert (topology.device_grid(inferred).ravel() == np.arange(64)).all()
  stated = mesh_lib.make_mesh("data=2x2,model=2", "h100")  # 2 nodes, 4 devices used in each.
  grid = topology.device_grid(stated)
  assert grid.tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]


def test_links_in_report_and_json():
  m = mesh_lib.make_mesh("stage=4,data=4,model=4", "h100")
  info = topology.links_json(m)
  assert info["data"] == {
    "link": "nvlink4+infiniband-ndr",
    "gb_per_s": pytest.approx(m.link("data").bandwidth / 1e9),
    "latency_us": pytest.approx(7 / 3),
    "ici": 2,
    "dcn": 2,
    "ici_links": 1,
    "stated": False,
  }
  line = topology.format_axis_links(m)
  assert "data nvlink4+infiniband-ndr 122.7 GB/s 2.3 us (2 ici x 2 dcn, inferred)" in line


def test_as_mesh_keeps_stated_splits_on_other_hardware():
  m = mesh_lib.make_mesh("data=2x4,model=2", "h100")
  a100, _ = mesh_lib.as_mesh(m, "a100-80g")
  assert _split(a100, "data") == (4, 2) and a100.link("data").stated


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


def test_cli_reports_each_axis_link_and_turns_a_bad_split_into_exit_2(capsys, tmp_path):
  import json

  from experiments import cli

  out = tmp_path / "plan.json"
  argv = ["partition", "mlp", "--hardware", "h100", "--agent", "tactic", "--json", str(out)]
  assert cli.main([*argv, "--mesh", "data=2x2,model=2"]) == 0
  assert "links: data nvlink4+infiniband-ndr 122.7 GB/s" in capsys.readouterr().out
  links = json.loads(out.read_text())["links"]
  assert (links["data"]["ici"], links["data"]["dcn"], links["data"]["stated"]) == (2, 2, True)
  assert links["model"]["link"] == "nvlink4"
  assert cli.main([*argv, "--mesh", "data=1x16,model=2"]) == 2
  assert capsys.readouterr().err.strip() == (
    "automap-rl partition: error: ICI parts data 16 x model 2 put 32 devices in one node, "
    "but a node of h100 has 8"
  )


def test_to_jax_mesh_lays_out_stated_splits_by_node():
  # Nodes of 2: data = 2 nodes x 2 in a node, model = 2 nodes x 1; node k holds ids 2k, 2k+1.
  two = dataclasses.replace(mesh_lib.HARDWARE["cpu"], devices_per_node=2)
  m = mesh_lib.make_mesh("data=2x2,model=2x1", two)
  jm = mesh_lib.to_jax_mesh(m)
  assert [[d.id for d in row] for row in jm.devices] == [[0, 2], [1, 3], [4, 6], [5, 7]]
  # The model groups pair devices of different nodes, the data groups pairs inside one.
  assert (m.link("model").ici, m.link("model").dcn) == (1, 2)
