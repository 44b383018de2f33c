"""`automap-rl partition WORKLOAD --mesh ... --hardware ... [--agent mcts --budget N --seed S |
--tactic NAME |
--agent learned --checkpoint POLICY]`: a plan (found by a search agent, a trained policy's
included, or written by an expert tactic) and its cost beside every expert tactic. The
command is `agents.partition` (the Python facade) with a terminal around it: the same
workload, mesh, agent, budget and seed give the same plan and cost.

WORKLOAD is a workload spec (`gpt:layers=8,d_model=1024`) or a user function
`package.module:function` (the part before the colon is not a workload family). The user function
takes no arguments
and returns one of:

- `(fn, args)`: the function to partition and a tuple of its example positional arguments
  (arrays or `jax.ShapeDtypeStruct`s, any pytrees); arguments are named `arg0, arg1, ...`
  and their roles are read from the step (`automap_rl.ir.infer_roles`: what it returns
  updated is state; a warning names the arguments where that is in doubt);
- `(fn, args, arg_names, arg_roles)`: the same with a name and a role (`parameter`,
  `optimizer_state`, `input`) per positional argument: the expert tactics need roles
  (data parallel shards `input`s, Megatron and FSDP `parameter`s);
- an `automap_rl.workloads.Workload`.

The module must be importable (on `PYTHONPATH`, or in the current directory).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import os
import sys
import time
from typing import Annotated, Any, Literal

import jax
import tyro
from tqdm import tqdm

import agents
from agents import learned
from agents.base import Budget
from agents.registry import AGENTS
from automap_rl import ir, workloads
from automap_rl.plan import cost_dict, fit_advice
from automap_rl.problem import Problem
from automap_rl.topology import links_json
from experiments.cli import CommandFailed, write_json
from experiments.options import (
  WORKLOAD_HELP,
  Hardware,
  JsonPath,
  MeshSpec,
  OptionalWorkload,
  PlotPath,
  Tactic,
)
from experiments.progress import phase, ticking


@dataclasses.dataclass(frozen=True)
class PartitionConfig:
  """What to partition and how.

  Attributes:
    workload: a workload spec or `package.module:function` returning `(fn, args)`,
      `(fn, args, arg_names, arg_roles)` or a `Workload`.
    mesh: the mesh spec.
    hardware: the hardware profile.
    agent: `tactic` (the plan of `--tactic`), or the search agent that finds the plan.
    tactic: the expert tactic that makes the plan (only with `--agent tactic`; default
      data_megatron).
    budget: the search budget: simulator evaluations (`2000`) or seconds (`30s`: tracing
      and building the cost tables included, `agents.partition`).
    seed: the search seed (the same seed and a simulations budget give the same plan).
    checkpoint: the policy of `--agent learned`: a policy directory or a training run
      directory (None: the policy shipped with the package).
    json: where to write the figures.
    plot: where to draw the largest arguments' shards (PNG).
    max_args: how many argument shardings to print.
    progress: show a progress bar while searching.
    check_numerics: lower the plan on the local devices (8 virtual CPU devices) and
      check its numbers against the unpartitioned step.
    check_workload: the workload spec to lower and check instead of `workload` (a
      smaller copy of it with real arrays; the plan is mapped onto it by
      `automap_rl.plan.transfer_decisions`).
  """

  workload: Annotated[
    str,
    tyro.conf.Positional,
    tyro.conf.arg(metavar="WORKLOAD", help=f"{WORKLOAD_HELP}; or package.module:function"),
  ] = "gpt"
  mesh: MeshSpec = "data=2,model=4"
  hardware: Hardware = "h100"
  agent: Literal[("tactic", *AGENTS)] = "tactic"  # type: ignore[valid-type]
  tactic: Tactic | None = None
  budget: str = "2000"
  seed: int = 0
  checkpoint: str | None = None
  json: JsonPath = None
  plot: PlotPath = None
  max_args: int = 12
  progress: bool = True
  check_numerics: bool = False
  check_workload: OptionalWorkload = None


def is_user_function(model: str) -> bool:
  """Whether MODEL names `package.module:function` rather than a zoo or external spec."""
  head, sep, _ = model.partition(":")
  return (
    bool(sep)
    and head.strip() not in workloads.FAMILIES + workloads.EXTERNAL_FAMILIES
    and "=" not in head
  )


def load_user_function(
  target: str,
) -> tuple[str, Any, tuple, tuple[str, ...] | None, tuple[str, ...] | None]:
  """Imports `package.module:function`, calls it, and returns (name, fn, args, names, roles)."""
  module_name, _, attr = target.partition(":")
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  factory = getattr(importlib.import_module(module_name), attr)
  made = factory()
  if isinstance(made, workloads.Workload):
    return made.name, made.step, made.args, made.arg_names, made.arg_roles
  if isinstance(made, tuple) and len(made) in (2, 4):
    fn, args = made[0], tuple(made[1])
    names, roles = (made[2], made[3]) if len(made) == 4 else (None, None)
    return target, fn, args, names, roles
  raise TypeError(
    f"{target} returned {type(made).__name__}; expected (fn, args), "
    "(fn, args, arg_names, arg_roles) or a Workload."
  )


def load(model: str) -> tuple[str, Any, tuple, ir.Program]:
  """(name, fn, example args, traced program) of a zoo spec or a user function (roles as
  `agents.partition` reads them: `ir.trace_step`)."""
  name, fn, args, names, roles = load_target(model)
  return name, fn, args, ir.trace_step(fn, *args, arg_names=names, arg_roles=roles)


def load_target(
  model: str,
) -> tuple[str, Any, tuple, tuple[str, ...] | None, tuple[str, ...] | None]:
  """(name, fn, example args, arg names, arg roles) of a zoo spec (abstract arguments) or a
  user function, nothing traced."""
  if is_user_function(model):
    return load_user_function(model)
  workload = workloads.make_workload(model, abstract=True)
  return workload.name, workload.step, workload.args, workload.arg_names, workload.arg_roles


def _clocks(config: PartitionConfig) -> bool:
  """Whether the phases show their clocks: asked for, and stderr is a terminal (piped or
  captured output, like an error a script reads, stays one line)."""
  return config.progress and sys.stderr.isatty()


class Phases:
  """The facade's phases on the terminal as they start (`agents.partition(phase=...)`):
  each with its clock, then the search's progress bar (`progress`)."""

  def __init__(self, config: PartitionConfig):
    self.config = config
    self.stack = contextlib.ExitStack()
    self.bar: tqdm | None = None

  def __call__(self, name: str) -> None:
    self.stack.close()
    if name == "searching":
      budget = Budget.of(self.config.budget)
      self.bar = self.stack.enter_context(
        tqdm(
          total=budget.simulations,
          desc=f"{self.config.agent} search",
          unit="sim",
          disable=not self.config.progress,
          dynamic_ncols=True,
        )
      )
      self.stack.enter_context(
        ticking(self.bar.refresh)
      )  # The bar's clock runs while the environment is built.
    else:
      self.stack.enter_context(phase(name, _clocks(self.config)))

  def progress(self, simulations: int, best_step_time: float) -> None:
    if self.bar is not None:
      self.bar.update(simulations - self.bar.n)
      self.bar.set_postfix_str(f"best {best_step_time * 1e3:.3f} ms", refresh=False)

  def __enter__(self) -> Phases:
    return self

  def __exit__(self, *exc) -> None:
    self.stack.close()


def lower_and_check(
  config: PartitionConfig, problem: Problem, decisions, fn, args
) -> dict[str, Any]:
  """Compiles the plan on the local devices and checks numerics (see `check_workload`)."""
  from automap_rl import plan as plan_lib
  from automap_rl.xla import hlo
  from automap_rl.xla.lower import lower
  from automap_rl.xla.numerics import check_numerics, compute_dtype, reference_outputs

  start = time.perf_counter()
  spec = config.check_workload or config.workload
  if spec != config.workload:
    print(
      f"\nlowering on {spec} with real arrays, a smaller copy of {config.workload} (the full model "
      "is too "
      "slow to compile and run on this machine's CPU cores)",
      flush=True,
    )
  with phase(f"building and tracing {spec} with real arrays", _clocks(config)):
    if is_user_function(spec):
      name, fn, args, names, roles = load_user_function(spec)
      target = (
        problem
        if spec == config.workload
        else Problem.build(ir.trace_step(fn, *args, arg_names=names, arg_roles=roles), problem.mesh)
      )
    else:
      workload = workloads.make_workload(spec)  # Real arrays.
      name, fn, args = workload.name, workload.step, workload.args
      target = Problem.build(workload.trace(), problem.mesh)
    moved = (
      decisions if target is problem else plan_lib.transfer_decisions(decisions, problem, target)
    )
  if spec != config.workload:
    print(f"{len(moved)} of {len(decisions)} decisions carried over to {name}")
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    # The unpartitioned reference runs compile beside the plan's compile (two cores).
    references = pool.submit(reference_outputs, fn, args, compute=compute_dtype(target.program))
    with phase(f"compiling the plan for {len(jax.devices())} devices", _clocks(config)):
      lowered = lower(target, moved, fn, args)
    with phase("checking numerics against the unpartitioned step", _clocks(config)):
      reference = check_numerics(fn, args, lowered, reference=references.result())
  summary = hlo.summarize(lowered.stats.collectives)
  seconds = time.perf_counter() - start
  print(
    f"lowered on {len(jax.devices())} {jax.devices()[0].platform.upper()} devices: "
    + (", ".join(f"{k} {n}x" for k, (n, _) in summary.items()) or "no collectives")
    + f"; numerics match the unpartitioned step, compared in {reference.note} ({seconds:.1f}s)"
  )
  return {
    "model": name,
    "decisions": [str(d) for d in moved],
    "ok": True,
    "reference": reference.note,
    "seconds": seconds,
    "collectives": {k: int(n) for k, (n, _) in summary.items()},
  }


DEFAULT_TACTIC = "data_megatron"


def run(config: PartitionConfig) -> dict[str, Any]:
  started = (
    time.monotonic()
  )  # A seconds budget covers the command from here, loading the workload included.
  if config.agent != "tactic" and config.tactic is not None:
    raise ValueError(
      f"--tactic {config.tactic} applies only with --agent tactic (the agent {config.agent} "
      "searches its own plan; the experts are reported beside it)."
    )
  if config.checkpoint is not None and config.agent != "learned":
    raise ValueError(
      f"--checkpoint applies only with --agent learned (the agent {config.agent} has no policy)."
    )
  Budget.of(config.budget)  # Bad budgets fail before tracing, whichever the agent.
  # The learned agent's policy, found (or refused) before tracing; None: no policy.
  policy = None
  if config.agent == "learned":
    policy = learned.LearnedConfig(checkpoint=learned.policy_path(config.checkpoint))
  config = dataclasses.replace(config, tactic=config.tactic or DEFAULT_TACTIC)
  name, fn, args, names, roles = load_target(config.workload)
  agent = config.tactic if config.agent == "tactic" else config.agent
  with Phases(config) as phases:
    plan = agents.partition(
      fn,
      *args,
      mesh=config.mesh,
      hardware=config.hardware,
      agent=agent,
      budget=config.budget,
      seed=config.seed,
      arg_names=names,
      arg_roles=roles,
      config=policy,
      progress=phases.progress,
      phase=phases,
      since=started,
    )
  problem, decisions, found = plan.problem, plan.decisions, plan.search
  with phase("costing the plan and the expert plans", _clocks(config)):
    result = cost_dict(plan.cost)
    result["baselines"] = plan.expert_costs  # Priced once: the report below reuses them.
  result["decisions"] = [str(d) for d in decisions]
  result["links"] = links_json(problem.mesh)
  result["agent"] = config.agent
  if policy is not None:
    result["checkpoint"] = policy.checkpoint
  result["search_seconds"] = 0.0 if found is None else found.seconds
  result["trace"] = [] if found is None else found.trace_dicts()
  if found is not None:
    result.update(
      actions=found.actions,
      simulations=found.simulations,
      greedy_steps=found.greedy_steps,
      seed=config.seed,
      budget=config.budget,
      setup_seconds=found.setup_seconds,
      stopped_by=found.stopped_by,
      lower_bound=found.lower_bound,
    )
  print(f"{name}" + ("" if found is None else f", seed {config.seed}") + ":")
  print(plan.report(config.max_args))
  print()
  print(plan.diagram())
  if config.check_numerics:
    result["numerics"] = lower_and_check(config, problem, decisions, fn, args)
  if config.plot:
    print(f"shards drawn in {plan.plot(config.plot)}")
  write_json(config.json, result)
  if not decisions:
    print(
      f"WARNING: the plan shards nothing: {plan.agent} found nothing better than replicating "
      f"{name}",
      file=sys.stderr,
    )
  if not result["fits"]:
    fitting = [n for n, b in result["baselines"].items() if b["fits"]]
    raise CommandFailed(
      f"the plan does not fit in memory: {fit_advice(problem, plan.cost)}"
      + (f"; experts that fit: {', '.join(fitting)}" if fitting else "; no expert plan fits either")
    )
  return result
