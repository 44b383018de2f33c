"""Published training runs: what large models were measured to cost on accelerators.

Each `PublishedRun` is one row of a paper's table (or a framework's published benchmark
table): the model, the hardware, the plan practitioners ran (tensor, pipeline, data, FSDP
and expert degrees, schedule, microbatches, activation recomputation), the global batch
and sequence, and the figure they measured: TFLOP/s per device counted with the paper's
own flop formula, or MFU as that paper defines it. `build` turns a row into the
simulator's problem and the published plan (decisions and pipeline), so the simulated
figure is computed with the same formula from the simulated step time.

Where the zoo cannot express the paper's model exactly (a head width that differs from
the residual width, a layer count a scanned stack cannot split evenly, SwiGLU experts), the
row simulates the closest zoo model and says so in `notes`; the simulated figure then
counts the flops of the simulated model (`model_flops.simulated_shape`), the published one is the
paper's number. Every number not stated by the source is marked as an estimate in `notes`.
"""

from __future__ import annotations

import dataclasses

from automap_rl import tactics
from automap_rl.mesh import Mesh, get_hardware, make_mesh, parse_mesh_spec
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.workloads import spec as spec_lib
from automap_rl.workloads.model_flops import FORMULAS, Shape, simulated_shape

# The mesh axes a plan's degrees map to, major to minor (the model axis last: the fastest
# link, as `tactics.model_axis` expects).
AXES = ("stage", "data", "fsdp", "expert", "model")
KINDS = ("tflops", "mfu")


@dataclasses.dataclass(frozen=True)
class Citation:
  """Where a row's numbers come from.

  Attributes:
    paper: authors and title (or the repository and file).
    venue: venue and year.
    where: the table or figure (and its row).
    short: a few words for tables.
  """

  paper: str
  venue: str
  where: str
  short: str

  def __str__(self) -> str:
    return f"{self.paper}, {self.venue}, {self.where}"


@dataclasses.dataclass(frozen=True)
class ParallelDegrees:
  """The parallel plan a run used, as degrees.

  Attributes:
    tensor: tensor (Megatron) parallel degree, on the `model` axis.
    pipeline: pipeline stages, on the `stage` axis.
    data: data-parallel replicas, on the `data` axis (parameters replicated).
    fsdp: fully sharded data-parallel degree, on the `fsdp` axis (batch and parameter,
      gradient and optimizer storage sharded, gathered at use).
    expert: expert-parallel degree, on the `expert` axis (batch and experts sharded).
    schedule: pipeline schedule (`pipeline.SCHEDULES`).
    chunks: layer chunks per stage (interleaved schedule).
    microbatch_size: sequences per microbatch per replica; microbatches = batch /
      (replicas x microbatch_size), run as a pipeline's microbatches or, with one stage,
      as gradient accumulation.
    recompute: what each layer's backward recomputes (the workload's `remat` and
      `remat_policy`): "full" (full activation recomputation), "dots" (no recomputation in a
      framework whose fused elementwise kernels recompute their cheap intermediates: the
      outputs of the matmuls without batch dims kept, `training.REMAT_POLICIES`) or "none"
      (every intermediate JAX's differentiation keeps).
    activation_split: how activations between the tensor-parallel blocks are stored over
      the `model` axis: whole (''), split by sequence ('sequence': Megatron-LM's sequence
      parallelism) or on the model width ('embedding': T5X's 2-D activation partitioning,
      GSPMD's layout of PaLM).
    zero: parameters, gradients and optimizer state also stored sharded over `data`
      (ZeRO-3 / FSDP), gathered at use.
    gather_weights_once: with microbatches, the weights stored sharded over the batch
      axes are gathered once a step and their gradients reduced once
      (`Pipeline.gather_weights_once`): with `zero`, Megatron-LM's distributed optimizer
      and FSDP without resharding after the forward pass.
  """

  tensor: int = 1
  pipeline: int = 1
  data: int = 1
  fsdp: int = 1
  expert: int = 1
  schedule: str = "1f1b"
  chunks: int = 1
  microbatch_size: int = 1
  recompute: str = "full"
  activation_split: str = ""
  zero: bool = False
  gather_weights_once: bool = False

  @property
  def degrees(self) -> dict[str, int]:
    """Mesh axis -> degree, in `AXES` order."""
    return {
      "stage": self.pipeline,
      "data": self.data,
      "fsdp": self.fsdp,
      "expert": self.expert,
      "model": self.tensor,
    }

  @property
  def devices(self) -> int:
    """Devices the plan runs on: the product of its degrees."""
    return self.tensor * self.pipeline * self.data * self.fsdp * self.expert

  @property
  def replicas(self) -> int:
    """Ways the batch is split across devices."""
    return self.data * self.fsdp * self.expert

  def describe(self) -> str:
    """The plan in a few words: each degree above 1 by its axis, the schedule, the
    microbatch size and the storage and recomputation flags (`stage16 data64 model8 1f1b
    mbs1 remat`)."""
    parts = [f"{k}{v}" for k, v in self.degrees.items() if v > 1]
    if self.pipeline > 1:
      parts.append(self.schedule + (f"x{self.chunks}" if self.chunks > 1 else ""))
    parts.append(f"mbs{self.microbatch_size}")
    flags = {
      "sp": self.activation_split == "sequence",
      "2d-act": self.activation_split == "embedding",
      "zero3": self.zero and not self.gather_weights_once,
      "zero-gathered-once": self.zero and self.gather_weights_once,
      "remat": self.recompute == "full",
      "remat-dots": self.recompute == "dots",
    }
    return " ".join(parts + [flag for flag, on in flags.items() if on])


@dataclasses.dataclass(frozen=True)
class PublishedRun:
  """One published training run.

  Attributes:
    name: the row's short name (`--rows`).
    citation: where its numbers come from.
    hardware: the hardware profile (`automap_rl.mesh.HARDWARE`).
    model: the workload spec simulated (scanned layers, abstract tracing).
    shape: the paper's model as its flop formula reads it.
    mesh: the mesh spec (axes in `AXES` order, one per degree above 1).
    plan: the published plan.
    batch: global batch in sequences.
    seq: sequence length.
    figure: the published figure.
    kind: `tflops` (TFLOP/s per device) or `mfu` (model flops utilization, a fraction).
    formula: the key in `model_flops.FORMULAS` of the paper's flop count.
    stated_params: the parameter count the paper states, or None.
    overlap: whether the run's software overlapped collectives with compute
      (`Hardware.async_collectives`): XLA's latency-hiding scheduler, PyTorch FSDP and
      Megatron-Core's overlapped gradient reduction do; Megatron-LM of 2021 reduced the
      gradients after the backward pass and exchanged pipeline activations blocking.
    notes: approximations and estimates (what the source does not state).
  """

  name: str
  citation: Citation
  hardware: str
  model: str
  shape: Shape
  mesh: str
  plan: ParallelDegrees
  batch: int
  seq: int
  figure: float
  kind: str
  formula: str
  stated_params: float | None = None
  overlap: bool = True
  notes: tuple[str, ...] = ()

  @property
  def devices(self) -> int:
    return self.plan.devices

  def figure_of(self, flops_per_step: float, step_time: float) -> float:
    """The row's figure (its `kind`) for a step of `flops_per_step` model flops taking
    `step_time` seconds on every device."""
    per_device = flops_per_step / step_time / self.devices
    if self.kind == "tflops":
      return per_device / 1e12
    return per_device / get_hardware(self.hardware).flops["bfloat16"]

  def published_flops(self) -> float:
    """The paper's flops per step (its formula on its model)."""
    return FORMULAS[self.formula](self.shape, self.batch, self.seq)

  def simulated_flops(self) -> float:
    """The same formula on the simulated model (`simulated_shape`)."""
    return FORMULAS[self.formula](simulated_shape(self.model), self.batch, self.seq)

  def format_figure(self, value: float) -> str:
    return f"{value:.1f} TF/s" if self.kind == "tflops" else f"{100 * value:.1f}% MFU"


def build_mesh(run: PublishedRun) -> Mesh:
  """The run's mesh: each axis on the link its spec states (`NAME=DCNxICI`) or implies, on
  the row's hardware with its software's overlap (`PublishedRun.overlap`)."""
  hardware = dataclasses.replace(get_hardware(run.hardware), async_collectives=run.overlap)
  return make_mesh(run.mesh, hardware)


def published_plan(problem: Problem, run: PublishedRun) -> tuple[list[Decision], Pipeline | None]:
  """The run's plan on `problem`: the batch over the data, FSDP and expert axes, Megatron on
  the model axis, experts over the expert axis, storage sharded over the FSDP axis (and the
  data axis with ZeRO), and the pipeline (stages on the stage axis, or gradient
  accumulation over the batch axis with one stage)."""
  plan, axes = run.plan, problem.mesh.axis_names
  batch_axes = tuple(a for a in ("data", "fsdp", "expert") if a in axes)
  found = tactics.structure(problem)
  # The experts take the expert axis before the batch does: the tokens dispatched to the
  # experts are then split by expert (and by data), as expert parallelism runs them, not
  # by batch over the expert axis with every expert's weights gathered.
  experts = tactics._shard_classes(problem, found.experts, "expert") if plan.expert > 1 else []
  decisions = experts + tactics._batch_over(problem, batch_axes)
  if plan.tensor > 1:
    decisions += tactics.megatron(problem)
  split = {"sequence": tactics.sequence_split, "embedding": tactics.embedding_split}
  if plan.activation_split:
    decisions += split[plan.activation_split](problem, "model")
  storage = tuple(a for a in ("fsdp",) + (("data",) if plan.zero else ()) if a in axes)
  if storage:
    decisions += tactics._store_sharded(problem, storage, found.kept_on_model)
  microbatches = run.batch // (plan.replicas * plan.microbatch_size)
  once = plan.gather_weights_once
  if plan.pipeline > 1:
    stack = tactics._largest_stack(problem)[0]
    pipeline = Pipeline(
      "stage", plan.pipeline, microbatches, plan.schedule, plan.chunks, stack,
      gather_weights_once=once,
    )  # fmt: skip
  elif microbatches > 1:
    pipeline = Pipeline(batch_axes[0], 1, microbatches, gather_weights_once=once)
  else:
    pipeline = None
  return decisions, pipeline


def build(run: PublishedRun) -> tuple[Problem, list[Decision], Pipeline | None]:
  """The run's problem (its model traced abstractly on its mesh) and its published plan."""
  program = spec_lib.make_workload(run.model, abstract=True).trace()
  problem = Problem.build(program, build_mesh(run))
  return (problem, *published_plan(problem, run))


def check(run: PublishedRun) -> None:
  """Raises ValueError naming what in a row is inconsistent: a mesh whose axes are not the
  plan's degrees, a batch the replicas and microbatches do not split, an unknown kind or
  formula, a model that is not the plan's recomputation or the row's batch and sequence."""
  degrees = {a: d for a, d in run.plan.degrees.items() if d > 1}
  if parse_mesh_spec(run.mesh) != degrees:
    raise ValueError(f"{run.name}: mesh {run.mesh!r} is not the plan's degrees {degrees}")
  if run.batch % (run.plan.replicas * run.plan.microbatch_size):
    raise ValueError(
      f"{run.name}: batch {run.batch} does not split into {run.plan.replicas} replicas x "
      f"microbatches of {run.plan.microbatch_size}"
    )
  width = {"sequence": run.seq, "embedding": run.shape.d_model, "": run.plan.tensor}
  if run.plan.activation_split not in width:
    raise ValueError(
      f"{run.name}: activation split {run.plan.activation_split!r} unknown (sequence, embedding)"
    )
  if width[run.plan.activation_split] % run.plan.tensor:
    raise ValueError(
      f"{run.name}: {run.plan.activation_split} {width[run.plan.activation_split]} does not "
      f"split over tensor parallelism {run.plan.tensor}"
    )
  if run.kind not in KINDS or run.formula not in FORMULAS:
    raise ValueError(f"{run.name}: kind {run.kind!r} or formula {run.formula!r} unknown")
  _, config = spec_lib.make_config(run.model)
  remat = {"full": (True, "full"), "dots": (True, "dots"), "none": (False, "full")}
  if run.plan.recompute not in remat:
    raise ValueError(f"{run.name}: recompute {run.plan.recompute!r} unknown ({', '.join(remat)})")
  if (config.batch, config.seq, config.remat, config.remat_policy) != (
    run.batch,
    run.seq,
    *remat[run.plan.recompute],
  ):
    raise ValueError(
      f"{run.name}: model {run.model!r} is not batch {run.batch}, seq {run.seq}, "
      f"recompute {run.plan.recompute}"
    )


# Why the TPU rows run with their collectives exposed (`PublishedRun.overlap` False).
_TPU_EXPOSED = (
  "collectives exposed, not overlapped: MaxText's v5e table measures the 64B model 12% "
  "slower a chip than the 32B, with the same flops and twice the FSDP traffic a chip; "
  "that is 90% of the added traffic's time exposed (XLA's TPU collectives of scanned "
  "layers, 2022-2024)"
)
_MEGATRON = Citation(
  "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
  "Megatron-LM",
  "SC 2021",
  "Table 1",
  "Narayanan+ SC21 T1",
)
# Table 1: (parameters in billions, heads, hidden size, layers, tensor, pipeline, GPUs,
# batch, achieved TFLOP/s per GPU).
_MEGATRON_ROWS = (
  ("1.7", 24, 2304, 24, 1, 1, 32, 512, 137),
  ("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
  ("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
  ("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
  ("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
  ("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
  ("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148),
  ("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
  ("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163),
  ("1008", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def _megatron_run(row: tuple) -> PublishedRun:
  size, heads, h, layers, tp, pp, gpus, batch, tflops = row
  dp = gpus // (tp * pp)
  plan = ParallelDegrees(tensor=tp, pipeline=pp, data=dp)
  return PublishedRun(
    name=f"megatron-{size}b",
    citation=_MEGATRON,
    hardware="a100-80g",
    model=f"gpt:layers={layers},d_model={h},heads={heads},seq=2048,vocab=51200,batch={batch},"
    "scan=true,remat=true,dtype=bfloat16,dropout=0.1",
    shape=Shape(layers, h, heads, h // heads, heads, 4 * h, 51200),
    mesh=",".join(f"{a}={d}" for a, d in plan.degrees.items() if d > 1),
    plan=plan,
    batch=batch,
    seq=2048,
    figure=tflops,
    kind="tflops",
    formula="megatron-2021",
    stated_params=float(size) * 1e9,
    overlap=False,
    notes=(
      "microbatch size 1 and the 1F1B schedule are estimates (Table 1 gives neither); "
      "without pipeline stages the batch runs as gradient accumulation",
      "attention and hidden dropout 0.1: Megatron-LM's defaults (the paper states none)",
    ),
  )


_LLAMA3 = Citation(
  "Grattafiori et al., The Llama 3 Herd of Models",
  "arXiv 2407.21783, 2024",
  "Table 4",
  "Llama 3 T4",
)
_LLAMA3_NOTES = (
  "128 layers simulated for the paper's 126 (a scanned stack splits evenly over 16 stages; the "
  "paper gives the first and last stage one layer less)",
  "the paper's interleaved schedule with 4 chunks per stage and microbatch size 1: estimates "
  "(neither is stated; with a bubble of (S - 1) / (V M), the 7% the paper loses from 8,192 to "
  "16,384 GPUs, where M halves from 32 to 16, lies between V = 4's 10% and V = 8's 5%, not at "
  "V = 2's 16%)",
  "the paper's FSDP as Sec. 3.3.2 describes it: parameters, gradients and optimizer state "
  "stored sharded over data, the weights not resharded after the forward pass (gathered once "
  "a step)",
  "Sec. 3.3.2 trains 8K sequences without activation checkpointing: simulated with the "
  "recomputation that keeps the projections' outputs and recomputes the elementwise ops "
  "('dots'), the closest that fits (none: 247 GB a device)",
  "activations split by sequence over the model axis (Megatron-LM's sequence parallelism, not "
  "stated): without it the first stage's microbatches in flight do not fit without "
  "recomputation",
  "flop formula not stated: Megatron-LM's assumed",
)


def _llama3_run(gpus: int, data: int, tflops: float) -> PublishedRun:
  return PublishedRun(
    name=f"llama3-405b-{gpus // 1024}k",
    citation=_LLAMA3,
    hardware="h100",
    model="llama:layers=128,d_model=16384,heads=128,kv_heads=8,d_ff=53248,vocab=128256,"
    "seq=8192,batch=2048,remat=true,remat_policy=dots,dtype=bfloat16,fused_attention=true",
    shape=Shape(126, 16384, 128, 128, 8, 53248, 128256, gated=True),
    mesh=f"stage=16,data={data},model=8",
    plan=ParallelDegrees(
      tensor=8,
      pipeline=16,
      data=data,
      schedule="interleaved",
      chunks=4,
      zero=True,
      gather_weights_once=True,
      recompute="dots",
      activation_split="sequence",
    ),
    batch=2048,
    seq=8192,
    figure=tflops,
    kind="tflops",
    formula="megatron-lm",
    stated_params=405e9,
    notes=_LLAMA3_NOTES,
  )


RUNS: tuple[PublishedRun, ...] = (
  *(_megatron_run(row) for row in _MEGATRON_ROWS),
  _llama3_run(8192, 64, 430),
  _llama3_run(16384, 128, 400),
  PublishedRun(
    name="palm-540b",
    citation=Citation(
      "Chowdhery et al., PaLM: Scaling Language Modeling with Pathways",
      "JMLR 2023 (arXiv 2204.02311)",
      "Sec. 4, Table 3 and Appendix B (238.3K tokens/s)",
      "PaLM T3/App. B",
    ),
    hardware="tpu-v4",
    model="llama:layers=118,d_model=18432,heads=48,kv_heads=1,d_ff=73728,vocab=256008,"
    "tie_embeddings=true,seq=2048,batch=2048,remat=true,dtype=bfloat16",
    shape=Shape(118, 18432, 48, 256, 1, 73728, 256000, gated=True, tied=True),
    mesh="data=2x1,fsdp=256,model=12",
    plan=ParallelDegrees(
      tensor=12, data=2, fsdp=256, microbatch_size=4, activation_split="embedding"
    ),
    batch=2048,
    seq=2048,
    figure=0.462,
    kind="mfu",
    formula="palm",
    stated_params=540.35e9,
    overlap=False,
    notes=(
      _TPU_EXPOSED,
      "heads of width 384 simulated for PaLM's 48 x 256 (the zoo's head width is d_model / "
      "heads); serial blocks for PaLM's parallel attention and FFN; RMSNorm for LayerNorm",
      "vocabulary padded to 256,008 so that the model axis's 12 shards split it (XLA pads "
      "uneven shards alike)",
      "data axis across the two pods on DCN, FSDP and model axes within a pod on ICI",
      "activations between layers split 12 ways on the model width, T5X's 2-D activation "
      "partitioning (the PaLM paper does not state its activation layout)",
      "batch 2048 x 2048 tokens, the last phase of the batch schedule (the MFU's batch is an "
      "estimate)",
    ),
  ),
  *(
    PublishedRun(
      name=f"maxtext-{size}b-v5e",
      citation=Citation(
        "MaxText, High Performance Model Training Configs on TPU v5e",
        "github.com/AI-Hypercomputer/maxtext, 2023-2024",
        f"MaxText/configs/v5e/README.md, 1x v5e-256 row, {size}B; configs/v5e/{size}b.sh",
        "MaxText v5e README",
      ),
      hardware="tpu-v5e",
      model=f"llama:layers={layers},d_model={width},heads=64,kv_heads=64,d_ff=28672,vocab=32000,"
      f"seq=2048,batch={256 * per_device},remat=true,dtype=bfloat16,fused_attention=true",
      shape=Shape(layers, width, 64, width // 64, 64, 28672, 32000, gated=True),
      mesh="fsdp=256",
      plan=ParallelDegrees(fsdp=256, microbatch_size=per_device),
      batch=256 * per_device,
      seq=2048,
      figure=tflops,
      kind="tflops",
      formula="maxtext",
      overlap=False,
      notes=(
        f"global_parameter_scale={size}: base.yml's 2048 / 16 heads / 7168 / 16 layers scaled "
        f"to {width} / 64 / 28672 / {layers}; per_device_batch_size={per_device}, remat full",
        "MaxText's flop formula of 2024 (non-causal attention); the table's own version is "
        "not recorded",
        _TPU_EXPOSED,
      ),
    )
    for size, layers, width, per_device, tflops in (
      (16, 32, 4096, 6, 120),
      (32, 32, 8192, 4, 132),
      (64, 64, 8192, 2, 118),
    )
  ),
  PublishedRun(
    name="bloom-176b",
    citation=Citation(
      "BigScience, BLOOM: A 176B-Parameter Open-Access Multilingual Language Model",
      "arXiv 2211.05100, 2022; GENCI, BLOOM award release, 2022",
      "Sec. 3.4 (384 A100 80GB, TP4 PP12 DP8, ZeRO stage 1): 156 TFLOPs, half the A100's 312; "
      "GENCI: 156 TFLOPs per GPU sustained (the model card's 'about 150' rounds it)",
      "BLOOM Sec. 3.4",
    ),
    hardware="a100-80g",
    model="gpt:layers=72,d_model=14336,heads=112,seq=2048,vocab=250880,batch=2048,scan=true,"
    "remat=true,dtype=bfloat16",
    shape=Shape(70, 14336, 112, 128, 112, 4 * 14336, 250880, tied=True),
    mesh="stage=12,data=8,model=4",
    plan=ParallelDegrees(
      tensor=4, pipeline=12, data=8, microbatch_size=2, zero=True, gather_weights_once=True
    ),
    batch=2048,
    seq=2048,
    figure=156,
    kind="tflops",
    formula="megatron-2021",
    stated_params=176.2e9,
    overlap=False,
    notes=(
      "72 layers simulated for BLOOM's 70 (a scanned stack splits evenly over 12 stages); "
      "learned positions for ALiBi, no embedding LayerNorm, the output layer not tied to the "
      "embedding",
      "ZeRO stage 1 as storage sharded over data with the weights gathered once a step; "
      "microbatch size 2, the 1F1B schedule and full recomputation are Megatron-DeepSpeed's "
      "training setup as reported, the schedule an estimate",
      "Jean Zay's nodes reach each other over 4 Omni-Path links of 100 Gb/s per 8 GPUs, a "
      "quarter of the profile's DGX A100 network",
    ),
  ),
  PublishedRun(
    name="mixtral-8x7b",
    citation=Citation(
      "Megatron-Core MoE (NVIDIA/Megatron-LM)",
      "megatron/core/transformer/moe/README.md, MCore v0.8-v0.9, 2024",
      "468 TFLOPS (v0.9) and Reference Best Parallel Mapping, Mixtral 8x7B row",
      "MCore MoE README",
    ),
    hardware="h100",
    model="moe:layers=32,d_model=4096,heads=32,d_ff=14336,seq=4096,vocab=32000,batch=256,"
    "experts=8,top_k=2,capacity_factor=1.0,gated=true,dispatch=gather,scan=true,remat=true,"
    "remat_policy=dots,dtype=bfloat16,fused_attention=true",
    shape=Shape(32, 4096, 32, 128, 8, 14336, 32000, gated=True, experts=8, top_k=2),
    mesh="stage=4,data=2,expert=8",
    plan=ParallelDegrees(
      pipeline=4, data=2, expert=8, schedule="interleaved", chunks=8, recompute="dots"
    ),
    batch=256,
    seq=4096,
    figure=468,
    kind="tflops",
    formula="megatron-lm",
    notes=(
      "the README ties 468 TFLOPS to MCore v0.9 and the mapping (64 GPUs, TP1 EP8 PP4 VP8, "
      "MBS 1, GBS 256, seq 4096) to v0.8: pairing them is an estimate",
      "optimizer state replicated over data: the distributed optimizer, as ZeRO storage with the "
      "weights gathered once a step, would gather over the expert axis too (the loop's batch "
      "axes)",
      "no recomputation (the mapping lists none), simulated as the activations Megatron-Core's "
      "fused kernels keep: the projections' outputs, the experts' with the tokens dispatched "
      "to them, the elementwise ops between them recomputed in the backward "
      "(remat_policy=dots)",
      "multi-head attention simulated for 8 KV groups; tokens permuted to their experts by "
      "index (dispatch=gather), at capacity factor 1 for dropless routing; XLA partitions the "
      "permutation with all-gathers where Megatron-Core's dispatcher runs all-to-alls",
    ),
  ),
)
_BY_NAME = {run.name: run for run in RUNS}


def get(names: tuple[str, ...] | list[str]) -> list[PublishedRun]:
  """The rows called `names` (all rows when empty); ValueError names an unknown row."""
  unknown = [n for n in names if n not in _BY_NAME]
  if unknown:
    raise ValueError(f"unknown row(s) {unknown}; valid rows: {', '.join(_BY_NAME)}")
  return [_BY_NAME[n] for n in names] if names else list(RUNS)
