"""`phalanx bench replay` on a few steps of digits: replays in processes of their own, per device."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from phalanx.errors import ConfigError
from phalanx.tools.bench.replay import run_replay_bench


def test_two_replays_on_one_device_and_thread_count_are_identical():
    out = io.StringIO()
    rows = run_replay_bench("digits-mlp", "", 3, [1], 4, ("cpu", "cpu"), console=Console(file=out, width=200))
    assert [(r["device"], r["threads"]) for r in rows] == [("cpu", 1), ("cpu", 1)]
    assert rows[1]["worst_part"] == 0.0 and rows[1]["whole"] == 0.0
    assert "identical" in out.getvalue()


def test_threads_and_devices_must_pair_up_and_a_missing_gpu_is_one_line():
    with pytest.raises(ConfigError, match="--threads and --devices: give one value or 3 of each"):
        run_replay_bench("digits-mlp", "", 3, [1, 2], 4, ("cpu", "cpu", "cpu"))
    with pytest.raises(ConfigError, match="--device cuda:99"):
        run_replay_bench("digits-mlp", "", 3, [1], 4, ("cpu", "cuda:99"))
