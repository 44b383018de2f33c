"""`automap-rl bench train`: training throughput over devices and processes.

For each device count n, the training config of a preset (with `--episodes` episodes, so
that every count splits them) on a `data` mesh of n devices (`agents.train.data_mesh`):
self-play samples (searched states) per second, from `agents.train.self_play` alone, and
whole iterations (self-play, replay, updates) per second, each timed over `--repeats`
calls after a compile and a warm-up call; the scaling efficiency is the rate over n times
the first row's rate per device.

Under `jax.distributed` (`--distributed.*` or the environment, as for `train`) every
process runs the same command and the device counts are of all processes together
(multiples of the process count); process 0 reports. On CPU devices the rates of more
devices than cores measure how XLA shares the cores, not more compute.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from agents import train
from experiments import train_cmd
from experiments.cli import write_json
from experiments.distributed import DistributedConfig, initialize
from experiments.options import JsonPath, PlotPath


@dataclasses.dataclass(frozen=True)
class TrainBenchConfig:
  """The training throughput benchmark.

  Attributes:
    preset: the `train` preset whose split, cases and training config are timed.
    episodes: episodes per iteration (B; every device count must divide it).
    devices: the device counts to time, each a multiple of the process count.
    repeats: timed calls of each function per device count (after one warm-up call).
    distributed: how this process joins a multi-process run (`experiments.distributed`).
    json: where to write the rows.
    plot: where to draw samples per second against devices.
  """

  preset: train_cmd.Preset = "smoke"
  episodes: int = 16
  devices: tuple[int, ...] = (1, 2, 4, 8)
  repeats: int = 3
  distributed: DistributedConfig = DistributedConfig()
  json: JsonPath = None
  plot: PlotPath = None


def seconds_per_call(fn: Callable[[], Any], repeats: int) -> float:
  """Mean wall seconds of `repeats` calls of `fn` after one warm-up call, blocking on every
  result (a fixed count, so that every process of a run makes the same calls)."""
  jax.block_until_ready(fn())
  start = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(fn())
  return (time.perf_counter() - start) / repeats


def measure(config: train.TrainConfig, suite: Any, devices: int, repeats: int) -> dict[str, float]:
  """Self-play samples per second and iterations per second on `devices` devices."""
  mesh = train.data_mesh(devices)
  train.check_mesh(config, mesh)
  state = train.replicate(train.init(config, suite), mesh)
  suite = train.replicate(suite, mesh)
  problems = jnp.arange(config.episodes, dtype=jnp.int32) % suite.size
  key = jax.random.key(config.seed)
  play = train.self_play.lower(state.params, suite, problems, key, config, mesh).compile()
  play_seconds = seconds_per_call(lambda: play(state.params, suite, problems, key), repeats)
  step = train.iteration.lower(state, suite, config, mesh).compile()
  iteration_seconds = seconds_per_call(lambda: step(state, suite), repeats)
  samples = config.episodes * config.episode_length
  return {
    "devices": devices,
    "processes": jax.process_count(),
    "self_play_seconds": play_seconds,
    "samples_per_second": samples / play_seconds,
    "iteration_seconds": iteration_seconds,
    "iterations_per_second": 1 / iteration_seconds,
  }


def with_efficiency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each row's rates over the first row's per device times its devices (1: linear)."""
  first = rows[0]
  for row in rows:
    scale = row["devices"] / first["devices"]
    row["samples_efficiency"] = row["samples_per_second"] / (first["samples_per_second"] * scale)
    row["iterations_efficiency"] = row["iterations_per_second"] / (
      first["iterations_per_second"] * scale
    )
  return rows


def table(rows: list[dict[str, Any]]) -> str:
  """The rows as a Markdown table."""
  lines = [
    "| devices | processes | self-play samples/s | efficiency | iterations/s | efficiency |",
    "|---" * 6 + "|",
  ]
  for r in rows:
    lines.append(
      f"| {r['devices']} | {r['processes']} | {r['samples_per_second']:,.1f} | "
      f"{r['samples_efficiency']:.2f} "
      f"| {r['iterations_per_second']:.3f} | {r['iterations_efficiency']:.2f} |"
    )
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], title: str, path: str) -> None:
  """Self-play samples per second and iterations per second against devices, with linear
  scaling from the first row."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
  xs = [r["devices"] for r in rows]
  for ax, key, label in zip(
    axes, ("samples_per_second", "iterations_per_second"), ("self-play samples/s", "iterations/s")
  ):
    ys = [r[key] for r in rows]
    ax.plot(xs, ys, "o-", label="measured")
    ax.plot(xs, [ys[0] * x / xs[0] for x in xs], "--", color="gray", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel(label)
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(config: TrainBenchConfig) -> list[dict[str, Any]]:
  initialize(config.distributed)
  if config.repeats < 1 or config.episodes < 1:
    raise ValueError("--repeats and --episodes must be at least 1.")
  preset = train_cmd.PRESETS[config.preset]
  run_config = dataclasses.replace(
    preset, progress=False, train=dataclasses.replace(preset.train, episodes=config.episodes)
  )
  for n in config.devices:  # Refuses what the devices cannot split before anything is built.
    if config.episodes % n:
      raise ValueError(
        f"--episodes {config.episodes} does not split over {n} devices; give a multiple of each "
        "count."
      )
    train.check_mesh(run_config.train, train.data_mesh(n))
  _, suite = train_cmd.build_suite(run_config)
  lead = train_cmd.is_lead()
  rows = []
  for n in config.devices:
    rows.append(measure(run_config.train, suite, n, config.repeats))
    if lead:
      r = rows[-1]
      print(
        f"{n} devices: {r['samples_per_second']:,.1f} self-play samples/s, "
        f"{r['iterations_per_second']:.3f} "
        f"iterations/s",
        flush=True,
      )
  rows = with_efficiency(rows)
  if lead:
    print(table(rows))
    write_json(config.json, {"preset": config.preset, "episodes": config.episodes, "rows": rows})
    if config.plot:
      plot(
        rows,
        f"training throughput, {config.preset} preset, {config.episodes} episodes, "
        f"{jax.process_count()} process(es)",
        config.plot,
      )
  return rows
