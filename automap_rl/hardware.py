"""The hardware a mesh's devices are: peak flop/s, memory, links, and how its XLA backend
compiles (`Hardware`), with a profile per device (`HARDWARE`).

Hardware figures are peak, per device, from the vendor documents cited next to each
number. Latencies are never in datasheets; they are marked as estimates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from automap_rl.topology import Link

__all__ = ["COMPILER_FIELDS", "HARDWARE", "MATMUL_PRIMITIVES", "Hardware", "get_hardware"]


# The ops `Hardware.matmul_flops` prices: contractions that run on matrix units.
MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})

# The fields of `Hardware` that describe its XLA backend (how its compiler combines,
# rewrites and fuses, and what its runtime adds per kernel), not the device's peaks:
# `Hardware.compiled_by` takes them from another.
COMPILER_FIELDS = (
  "combine_threshold",
  "reduce_scatter",
  "dense_batch_group_conv",
  "multi_output_fusion",
  "minor_concatenate_fusion",
  "canonical_convolutions",
  "fused_kernels",
  "async_collectives",
  "kernel_overhead_s",
)


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Peak capabilities of one device and of the links around it.

  Attributes:
    name: Profile name, the key in `HARDWARE`.
    flops: Peak flop/s per device keyed by dtype name ('float32', 'bfloat16',
      'float16', 'int8'); dense (no structured sparsity).
    matmul_flops: Peak flop/s of dots and convolutions where XLA's default precision runs
      them on other units than `flops` gives for their dtype, keyed likewise: float32 on
      TF32 tensor cores on A100 and H100 (XLA:GPU's default for float32 dots and
      convolutions; measured on one H100, see BENCHMARKS.md). Dtypes not in it take `flops`.
    hbm_bytes: Accelerator memory capacity per device, bytes.
    hbm_bandwidth: Accelerator memory bandwidth per device, bytes/s.
    intra_node: Link between devices of the same node (ICI); on a torus, one of a chip's
      links in one direction.
    inter_node: Link between devices of different nodes (DCN), per device.
    devices_per_node: How many devices share the intra-node link: a GPU server, a TPU
      pod (the largest ICI domain).
    torus_dims: Dimensions of the torus the intra-node links form (0: a switched node,
      NVSwitch, where every device reaches every other at `intra_node`'s rate). The
      torus has `torus_extent` chips along each dimension.
    torus_wrap: A torus slice wraps around (a ring along a dimension closes) when its
      extent along every dimension is a multiple of this (`topology.torus_links`).
    combine_threshold: Collective kind -> the most bytes XLA's combiner for that
      kind merges into one collective (`inf`: no limit); kinds without a
      combiner on this backend are absent.
    reduce_scatter: Whether XLA runs a reduce-scatter as one collective on this
      backend; where not, it runs an all-reduce and keeps its shard (a dynamic
      slice), which moves an all-reduce's bytes.
    dense_batch_group_conv: Whether XLA computes a convolution with `batch_group_count
      = B > 1` (the kernel gradient of a grouped or depthwise convolution) as a dense
      convolution over all B groups and masks the result: B times the flops.
    multi_output_fusion: Whether XLA fuses an elementwise chain that writes several
      results (an optimizer's new parameter and moments) into one kernel. Where not, each
      result that is written anyway is its own fusion, and the fusions that go on from it
      read it back from memory.
    matmul_efficiency: The share of the peak matmul flop/s (`flops`, `matmul_flops`) that
      the best-shaped large matmul reaches on this device, as measured (Bekman, "Machine
      Learning Engineering", compute/accelerator: Maximum Achievable Matmul FLOPS, bf16);
      dots and convolutions run at peak times this (`achievable_flops`). 1 where no
      measurement is published.
    minor_concatenate_fusion: Whether XLA fuses a concatenate along its minor (last)
      dimension with its operands' producers and its readers. XLA:CPU does not (its
      instruction fusion: rows of at least 64 bytes and 2 KiB in all, or more than 8
      operands): the concatenate is a data-movement kernel of its own, its operands are
      written to memory and read back, and its result is written.
    canonical_convolutions: Whether the compiler runs every convolution in one layout
      (XLA:CPU's ConvCanonicalization: input batch-major and features minor, kernel
      spatial dims first then input and output features). A convolution whose operand
      is in another layout (a backward's: the kernel gradient contracts the batch, the
      input gradient reads the kernel's features swapped) has it transposed by a kernel
      of its own, which reads and writes it
      (`fusion.traffic.transposed_convolution_operands`).
    fused_kernels: Whether the compiler runs the fused kernels a step marks
      (`automap_rl.ir.kernels`: flash attention, as cuDNN's fused attention on GPUs and
      Pallas' flash attention on TPUs) as one kernel each, their intermediates on chip.
      XLA:CPU runs their ops as written.
    async_collectives: Whether the compiler runs collectives asynchronously and schedules
      them against compute that does not depend on them (XLA's latency-hiding scheduler on
      GPUs and TPUs): the reshards of parameters and the reductions of weight gradients
      hide behind compute (`simulator.tables.overlap`). XLA:CPU runs each collective in
      program order, the devices waiting for it.
    kernel_overhead_s: Seconds each kernel a step launches adds beyond its roofline time
      (`simulator.fusion.kernel_launches`): its launch and the gap before the next kernel
      starts, a loop iteration's condition included. It does not shrink with sharding: a
      device launches every kernel of its program. 0 where the profile's compiled-implied
      validation counts none (XLA:CPU) or where no one-device measurement exists.
  """

  name: str
  flops: Mapping[str, float]
  hbm_bytes: float
  hbm_bandwidth: float
  intra_node: Link
  inter_node: Link
  devices_per_node: int
  combine_threshold: Mapping[str, float]
  matmul_flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
  reduce_scatter: bool = True
  dense_batch_group_conv: bool = False
  multi_output_fusion: bool = True
  minor_concatenate_fusion: bool = True
  canonical_convolutions: bool = False
  matmul_efficiency: float = 1.0
  torus_dims: int = 0
  torus_wrap: int = 1
  fused_kernels: bool = False
  async_collectives: bool = True
  kernel_overhead_s: float = 0.0

  @property
  def torus_extent(self) -> int:
    """Chips along one dimension of the node's torus (`devices_per_node ** (1 / dims)`)."""
    return round(self.devices_per_node ** (1 / self.torus_dims)) if self.torus_dims else 1

  def compiled_by(self, backend: Hardware) -> Hardware:
    """This device's peaks, memory and links with `backend`'s compiler (`COMPILER_FIELDS`):
    a GPU's plan priced as XLA:CPU compiles it."""
    return dataclasses.replace(
      self, **{field: getattr(backend, field) for field in COMPILER_FIELDS}
    )

  def peak_flops(self, primitive: str, dtype: str) -> float:
    """Peak flop/s of an op of `primitive` whose result is `dtype` (dtypes without a rate
    take float32's)."""
    if primitive in MATMUL_PRIMITIVES and dtype in self.matmul_flops:
      return self.matmul_flops[dtype]
    return self.flops.get(dtype, self.flops["float32"])

  def achievable_flops(self, primitive: str, dtype: str) -> float:
    """The flop/s an op of `primitive` whose result is `dtype` runs at: a matmul's peak
    times `matmul_efficiency`, any other op's peak."""
    efficiency = self.matmul_efficiency if primitive in MATMUL_PRIMITIVES else 1.0
    return self.peak_flops(primitive, dtype) * efficiency


_GB = 1e9
# XLA's GPU defaults of xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes
# (xla/debug_options_flags.cc), kDefault{AllReduce,AllGather,ReduceScatter}CombineThreshold
# = 30 * 1024 * 1024 + 7 bytes in xla/service/collective_utils.h.
_GPU_COMBINE = {
  kind: 30 * 1024 * 1024 + 7 for kind in ("all-reduce", "all-gather", "reduce-scatter")
}


# Per-kernel overhead of XLA:GPU, derived from one-device steps measured on an H200
# (docs/experiments/data/step_h200_measured.json) against the simulated roofline: the two
# loop-bound families, whose many small kernels leave little else to explain the difference,
# take 0.93 us (Mamba-130m's selective scan over time, 2.56 M kernels a step) and 1.10 us
# (the LSTM 2048-512, 15 k) more per kernel. The H100's measured steps of those workloads
# are within 7% of the H200's.
_GPU_KERNEL_OVERHEAD_S = 1.0e-6


def _a100(name: str, hbm_bytes: float, hbm_bandwidth: float) -> Hardware:
  """An A100 SXM in a DGX A100; the two memory sizes differ only in HBM."""
  return Hardware(
    name=name,
    flops={
      # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM columns, dense
      # (without structured sparsity); the same for 40GB and 80GB.
      "float32": 19.5e12,  # datasheet "FP32" (non-tensor-core).
      "bfloat16": 312e12,  # datasheet "BFLOAT16 Tensor Core".
      "float16": 312e12,  # datasheet "FP16 Tensor Core".
      "int8": 624e12,  # datasheet "INT8 Tensor Core".
    },
    matmul_flops={"float32": 156e12},  # datasheet "TF32 Tensor Core" 312 / 2 (dense).
    hbm_bytes=hbm_bytes,
    hbm_bandwidth=hbm_bandwidth,
    intra_node=Link(
      name="nvlink3",
      # A100 datasheet: NVLink 600 GB/s, bidirectional total -> 300 one way.
      bandwidth=300 * _GB,
      latency=2e-6,  # Estimate (order of NCCL small-message latency).
    ),
    inter_node=Link(
      name="infiniband-hdr",
      # NVIDIA DGX A100 user guide: one ConnectX-6 200 Gb/s HDR port per
      # GPU -> 200e9 / 8 = 25 GB/s per device per direction.
      bandwidth=25 * _GB,
      latency=5e-6,  # Estimate (IB switch hop + NCCL overhead).
    ),
    devices_per_node=8,  # NVIDIA DGX A100 user guide: 8 GPUs per system.
    combine_threshold=_GPU_COMBINE,
    # Bekman's Maximum Achievable Matmul FLOPS table: A100 SXM bf16 271.2 of 312 TFLOPS.
    matmul_efficiency=271.2 / 312,
    fused_kernels=True,  # cuDNN's fused (flash) attention runs on Ampere.
    kernel_overhead_s=_GPU_KERNEL_OVERHEAD_S,  # Estimate: the H100's and H200's launch path.
  )


# A100 40GB SXM: A100 datasheet "40GB HBM2", "1,555 GB/s".
_A100_40G = _a100("a100-40g", 40 * _GB, 1.555e12)
# A100 80GB SXM: A100 datasheet "80GB HBM2e", "2,039 GB/s".
_A100_80G = _a100("a100-80g", 80 * _GB, 2.039e12)

_H100 = Hardware(
  name="h100",
  flops={
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column, dense
    # (the datasheet's headline figures are with sparsity, i.e. 2x).
    "float32": 67e12,  # datasheet "FP32" (non-tensor-core).
    "bfloat16": 989e12,  # datasheet "BF16 Tensor Core" 1979 / 2.
    "float16": 989e12,  # datasheet "FP16 Tensor Core" 1979 / 2.
    "int8": 1979e12,  # datasheet "INT8 Tensor Core" 3958 / 2.
  },
  matmul_flops={"float32": 494.5e12},  # datasheet "TF32 Tensor Core" 989 / 2 (dense).
  hbm_bytes=80 * _GB,  # H100 datasheet, SXM5: 80 GB HBM3.
  hbm_bandwidth=3.35e12,  # H100 datasheet, SXM5: 3.35 TB/s.
  intra_node=Link(
    name="nvlink4",
    # H100 datasheet: NVLink 900 GB/s, bidirectional total -> 450 one way.
    bandwidth=450 * _GB,
    latency=2e-6,  # Estimate (order of NCCL small-message latency).
  ),
  inter_node=Link(
    name="infiniband-ndr",
    # NVIDIA DGX H100 user guide: one ConnectX-7 400 Gb/s NDR port
    # per GPU -> 400e9 / 8 = 50 GB/s per device per direction.
    bandwidth=50 * _GB,
    latency=5e-6,  # Estimate (IB switch hop + NCCL overhead).
  ),
  devices_per_node=8,  # NVIDIA DGX H100 user guide: 8 GPUs per system.
  combine_threshold=_GPU_COMBINE,
  # Bekman's Maximum Achievable Matmul FLOPS table: H100 SXM bf16 794.5 of 989 TFLOPS.
  matmul_efficiency=794.5 / 989,
  fused_kernels=True,  # cuDNN's fused (flash) attention.
  kernel_overhead_s=_GPU_KERNEL_OVERHEAD_S,
)


# H200 SXM: the H100 SXM5's compute and NVLink (H200 datasheet: same "BF16 Tensor Core",
# "TF32 Tensor Core" and "NVLink 900GB/s"), with 141 GB of HBM3e at 4.8 TB/s.
# Bekman's Maximum Achievable Matmul FLOPS table: GH200 (the H200's die and 141 GB of HBM3e)
# bf16 828.6 of 989 TFLOPS.
_H200 = dataclasses.replace(
  _H100, name="h200", hbm_bytes=141 * _GB, hbm_bandwidth=4.8e12, matmul_efficiency=828.6 / 989
)

HARDWARE: Mapping[str, Hardware] = {
  "h100": _H100,
  "h200": _H200,
  "a100-40g": _A100_40G,
  "a100-80g": _A100_80G,
  # The 80GB A100 (a100-80g's figures) under the name older specs use.
  "a100": dataclasses.replace(_A100_80G, name="a100"),
  "tpu-v4": Hardware(
    name="tpu-v4",
    flops={
      # Cloud TPU v4 docs (system architecture): 275 TFLOPS bf16 or int8.
      "bfloat16": 275e12,
      "int8": 275e12,
      # Estimate, not a vendor figure: the MXU has no fp32 mode; XLA's
      # highest-precision f32 matmul costs ~6 bf16 passes.
      "float32": 275e12 / 6,
      # Estimate, not a vendor figure: f16 is computed through bf16 MXUs.
      "float16": 275e12,
    },
    hbm_bytes=32 * 2**30,  # Cloud TPU v4 docs: 32 GiB HBM2.
    hbm_bandwidth=1200 * _GB,  # Cloud TPU v4 docs: 1200 GBps.
    intra_node=Link(
      name="ici",
      # Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer for Machine
      # Learning with Hardware Support for Embeddings" (ISCA 2023): six ICI links per
      # chip (a 3-D torus), ~50 GB/s each way each.
      bandwidth=50 * _GB,
      latency=1e-6,  # Estimate (one ICI hop plus launch overhead).
    ),
    inter_node=Link(
      name="dcn",
      # Estimate, not a vendor figure: data-center network between
      # slices, ~100 Gb/s per host NIC shared by 4 chips.
      bandwidth=100e9 / 8 / 4,
      latency=10e-6,  # Estimate (datacenter network round trip / 2).
    ),
    devices_per_node=4096,  # Cloud TPU v4 docs: TPU Pod size 4096 chips.
    # Jouppi et al. (ISCA 2023): a 3-D torus of 4x4x4 cubes joined by optical circuit
    # switches, 16x16x16 in a pod. Cloud TPU v4 docs ("3D mesh and 3D torus"): a slice
    # is a torus when each dimension is a multiple of 4 (whole cubes), else a 3-D mesh.
    torus_dims=3,
    torus_wrap=4,
    fused_kernels=True,  # Pallas' flash attention.
    # Estimate, not a documented figure: libtpu's combine thresholds are not
    # published; taken to be XLA's GPU defaults.
    combine_threshold=_GPU_COMBINE,
  ),
  "tpu-v5e": Hardware(
    name="tpu-v5e",
    flops={
      # Cloud TPU v5e docs (system architecture): 197 TFLOPS bf16,
      # 394 TOPS int8.
      "bfloat16": 197e12,
      "int8": 394e12,
      # Estimate, not a vendor figure: ~6 bf16 passes per f32 matmul.
      "float32": 197e12 / 6,
      # Estimate, not a vendor figure: f16 is computed through bf16 MXUs.
      "float16": 197e12,
    },
    hbm_bytes=16 * _GB,  # Cloud TPU v5e docs: 16 GB HBM2.
    hbm_bandwidth=819 * _GB,  # Cloud TPU v5e docs: 819 GBps.
    intra_node=Link(
      name="ici",
      # Cloud TPU v5e docs: 1600 Gbps ICI per chip, over 4 ports of a
      # 2D torus -> 1600e9 / 8 / 4 = 50 GB/s per port.
      bandwidth=1600e9 / 8 / 4,
      latency=1e-6,  # Estimate (one ICI hop plus launch overhead).
    ),
    inter_node=Link(
      name="dcn",
      # Estimate, not a vendor figure: ~200 Gb/s per host NIC shared by
      # the 8 chips of a v5litepod-8 host.
      bandwidth=200e9 / 8 / 8,
      latency=10e-6,  # Estimate (datacenter network round trip / 2).
    ),
    devices_per_node=256,  # Cloud TPU v5e docs: up to 256 chips per Pod.
    # Cloud TPU v5e docs: "Interconnect topology 2D Torus", 4 ICI ports per chip, slices
    # 1x1 to 16x16. Taken to wrap around only along whole 16-chip rows (the full pod), as
    # the JAX team's "How to Scale Your Model" (2025, "How to Think About TPUs") describes.
    torus_dims=2,
    torus_wrap=16,
    fused_kernels=True,  # Pallas' flash attention.
    # Estimate, not a documented figure (see tpu-v4).
    combine_threshold=_GPU_COMBINE,
  ),
  "cpu": Hardware(
    name="cpu",
    # A modest host; every figure is an assumption, not a datasheet value.
    flops={
      "float32": 1e11,  # Assumed: ~8 cores x 2 FMA x 8 lanes x 0.8 GHz.
      "bfloat16": 1e11,  # Assumed: no native bf16 matmul units.
      "float16": 1e11,  # Assumed: no native f16 matmul units.
      "int8": 2e11,  # Assumed: VNNI-style 2x over f32.
    },
    hbm_bytes=16 * _GB,  # Assumed: 16 GB of DRAM.
    hbm_bandwidth=20 * _GB,  # Assumed: ~one DDR4-2666 channel pair.
    intra_node=Link(
      name="shared-memory",
      bandwidth=10 * _GB,  # Assumed: memcpy between processes/threads.
      latency=1e-6,  # Assumed: thread hand-off.
    ),
    inter_node=Link(
      name="ethernet-10g",
      bandwidth=10e9 / 8,  # IEEE 802.3ae 10 Gigabit Ethernet line rate.
      latency=50e-6,  # Estimate (TCP round trip / 2 on a LAN).
    ),
    devices_per_node=64,  # Assumed: virtual devices of one host process.
    # XLA's CPU compiler (xla/service/cpu/cpu_compiler.cc) runs only an
    # all-reduce combiner, CpuAllReduceCombiner(kCombineBytes = INT64_MAX,
    # kCombineCount = 256): no byte limit. It writes a reduce-scatter as an
    # all-reduce and a dynamic slice, so reduce-scatters combine with it too.
    combine_threshold={"all-reduce": float("inf"), "reduce-scatter": float("inf")},
    # The SPMD partitioner writes a reduce-scatter as an all-reduce and a
    # dynamic slice; only the GPU pipeline turns that back into one
    # (ReduceScatterCreator, xla/service/gpu/transforms/).
    reduce_scatter=False,
    # The CPU compiler's ConvolutionGroupConverter (convert_batch_groups_only)
    # expands batch-grouped convolutions into dense ones with a mask.
    dense_batch_group_conv=True,
    # No multi-output fusion pass in the CPU compiler: Adam's update is three loop
    # fusions, the parameter's reading the new moments from memory (10 passes over a
    # parameter's size, not 7).
    multi_output_fusion=False,
    # A concatenate along the minor dim is its own kernel: "LLVM tends to do a better
    # job with pure data movement loops" (xla/service/cpu/cpu_instruction_fusion.cc).
    minor_concatenate_fusion=False,
    # ConvCanonicalization (xla/service/cpu/conv_canonicalization.cc) transposes a
    # convolution's operands into NHWC / HWIO unless they are in it.
    canonical_convolutions=True,
    # XLA:CPU's collectives are synchronous: each runs where the program puts it.
    async_collectives=False,
  ),
}


def get_hardware(name: str) -> Hardware:
  """Returns the hardware profile called `name` (a key of `HARDWARE`)."""
  try:
    return HARDWARE[name]
  except KeyError:
    raise ValueError(f"Unknown hardware {name!r}; valid names: {sorted(HARDWARE)}.") from None
