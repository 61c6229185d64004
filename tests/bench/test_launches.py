"""benchmarks/launches.py's host side, on CPU: the launch probe's arithmetic over a clock and
launches it is given, and the lines it prints."""
from __future__ import annotations

import pytest

from benchmarks.launches import QUEUED, launched, mode_line, probe_line


def test_the_probe_times_one_launch_alone_after_an_untimed_one_then_bursts_queued_back_to_back():
    """A launch that holds the host 2 ms, a burst the GPU runs in 10 ms, and a GPU that starts only
    once the launch returns: alone 12 ms, queued 10 ms a burst (each next launch runs beside the
    burst before it; the clock starts once the first is launched), so the GPU waits 2 ms a launch.
    The first launch (its upload) is not timed."""
    now, gpu_free, log = [0.0], [0.0], []

    def launch() -> None:
        now[0] += 0.002
        gpu_free[0] = max(gpu_free[0], now[0]) + 0.010
        log.append("launch")

    def synchronize() -> None:
        now[0] = max(now[0], gpu_free[0])
        log.append("sync")

    row = launched("a burst", launch, synchronize, clock=lambda: now[0])
    assert log == ["launch", "sync", "launch", "sync", *["launch"] * QUEUED, "sync"]
    assert row["host_ms"] == pytest.approx(2.0) and row["alone_ms"] == pytest.approx(12.0)
    assert row["queued_ms"] == pytest.approx(10.0) and row["wait_ms"] == pytest.approx(2.0)


def test_the_lines_name_what_they_measured():
    row = dict(label="chain k = 4, a burst of 16 rounds", host_ms=2.1, alone_ms=16.0, queued_ms=14.0, wait_ms=2.0)
    assert probe_line(row) == ("launch probe: chain k = 4, a burst of 16 rounds: the host's launch 2.100 ms; one "
                                "burst alone 16.000 ms; queued back to back 14.000 ms a burst: the GPU waits 2.000 ms "
                                "a launch")
    modes = dict(tokens=256, rounds=256, sent=256, wall_ms=229.6, vd_us=712.7, busy=256 * 712.7 / 229600)
    assert mode_line("chain k = 4", "overlap", modes) == ("modes: chain k = 4, overlap: 256 tokens in 256 rounds (256 "
                                                          "sent) in 229.60 ms, 896.9 us a round; v + d 712.7 us: 79% "
                                                          "busy")
