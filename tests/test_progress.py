"""Phases that report nothing themselves still show their clock every second."""

from __future__ import annotations

import time

from experiments import progress


def test_ticking_refreshes_every_interval_until_the_block_ends():
  calls = []
  with progress.ticking(lambda: calls.append(time.perf_counter()), interval=0.05):
    time.sleep(0.32)
  count = len(calls)
  time.sleep(0.15)
  assert 4 <= count <= 7
  assert len(calls) == count  # Stopped with the block.


def test_phase_leaves_its_label_and_time_on_stderr(capsys):
  with progress.phase("compiling the plan"):
    time.sleep(1.2)
  err = capsys.readouterr().err
  assert err.count("compiling the plan: 00:0") >= 2  # The first draw, then at least one tick.
