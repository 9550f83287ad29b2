"""`tiny-gpt` trained by three `phalanx join` processes on loopback, and by `phalanx swarm`, which judges
it by validation loss (and perplexity), not accuracy."""

import math
import os
import re
import subprocess
import sys

import hivemind
import pytest

from tests.peer.trainer_procs import join_args
from tests.procs import LOOPBACK, spawn_events

# the swarm test: a model small enough for two shared cores, and a threshold measured on it
SWARM_OPTIONS = "dim=64,layers=2,heads=4,context=64"
TARGET_LOSS = 3.0  # one process at this size and batch 48: 5.49 untrained, 2.92 after 75 steps, 2.51 after 150


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_three_cli_peers_train_tiny_gpt_below_a_validation_loss_that_an_untrained_model_is_far_from(tmp_path):
    dht = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    boot = [str(m) for m in dht.get_visible_maddrs()]
    common = (
        "--task", "tiny-gpt", "--task-options", SWARM_OPTIONS, "--batch-size", "16", "--target-loss", str(TARGET_LOSS),
        "--eval-every", "25", "--steps", "600", "--wait-for-peers", "3",
    )  # fmt: skip
    procs = [spawn_events(join_args(boot, tmp_path, n, *common), tmp_path / f"{n}.log") for n in "abc"]
    try:
        first = procs[0].next_event("eval", timeout=300)
        assert first["step"] == 25 and first["loss"] > TARGET_LOSS + 1, first  # far above the target early on
        reports = [p.next_event("done", timeout=800) for p in procs]
        for report in reports:
            assert report["reached_target"], report
            assert report["step"] < 600
        evals = [e for e in procs[0].seen if e.get("event") == "eval"]
        assert evals[-1]["loss"] <= TARGET_LOSS and evals[-1]["perplexity"] == pytest.approx(
            math.exp(evals[-1]["loss"])
        )
        assert len({r["param_hash"] for r in reports}) == 1
        print(f"tiny-gpt swarm: {[(e['step'], round(e['loss'], 3)) for e in evals]}")
    finally:
        for p in procs:
            p.kill()
        dht.shutdown()


def _swarm(scratch, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    """`phalanx swarm` on tiny-gpt at SWARM_OPTIONS, its temporary folder in `scratch`: (result, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "swarm", "--task", "tiny-gpt", "--task-options", SWARM_OPTIONS, *args],
        capture_output=True, text=True, timeout=800, env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert not list(scratch.glob("phalanx-swarm-*")), done.stderr[-3000:]  # a run that succeeded leaves no folder
    assert str(scratch) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return done, done.stderr


def _final_rows(err: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in err.splitlines() if re.match(r"│ trainer-\d", line)]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_swarm_with_no_target_succeeds_by_its_steps_and_reports_validation_loss_and_perplexity(short_tmp):
    done, err = _swarm(short_tmp, "--peers", "2", "--steps", "40", "--eval-every", "20")
    assert done.returncode == 0, err[-3000:]
    assert "NOT reached" not in err and "accuracy" not in err, err[-3000:]
    header = next(line for line in err.splitlines() if "┃ peer" in line)
    assert [c.strip() for c in header.split("┃")[1:6]] == ["peer", "id", "steps", "val loss", "perplexity"], header
    rows = _final_rows(err)
    assert len(rows) == 2 and all(r[2] == "40" and r[-1] == "steps done" for r in rows), rows
    for row in rows:
        assert float(row[4]) == pytest.approx(math.exp(float(row[3])), rel=1e-3)  # perplexity of that loss
    # the last one: the summary's (the live line says it too, with the best loss so far)
    best = re.findall(r"best validation loss (\d+\.\d+) \(perplexity (\d+\.\d+)\)", err)
    assert best and float(best[-1][0]) == min(float(r[3]) for r in rows), err[-1000:]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_swarm_stops_when_a_trainers_validation_loss_reaches_its_target_loss(short_tmp):
    done, err = _swarm(short_tmp, "--peers", "3", "--target-loss", str(TARGET_LOSS), "--eval-every", "25", "--steps", "600")
    assert done.returncode == 0, err[-3000:]
    assert re.search(rf"reached {TARGET_LOSS} after \d+\.\d s", err), err[-3000:]
    rows = _final_rows(err)
    assert any(r[-1] == "target reached" for r in rows) and all(int(r[2]) < 600 for r in rows), rows
    assert min(float(r[3]) for r in rows) <= TARGET_LOSS, rows


def test_the_live_line_and_table_show_the_tasks_metric(tmp_path):
    """What `phalanx swarm` prints while it runs: validation loss and perplexity for a language model (the
    best is the lowest), test accuracy for a classifier (the highest)."""
    import io

    from rich.console import Console

    from phalanx.tasks import ACCURACY, VALIDATION_LOSS
    from phalanx.tools.launcher.swarm import Swarm

    for metric, values, best in ((VALIDATION_LOSS, (2.9, 2.5), "best validation loss 2.5000 (perplexity 12.18)"),
                                 (ACCURACY, (0.9, 0.5), "best test accuracy 0.9000")):  # fmt: skip
        out = io.StringIO()
        swarm = Swarm(2, ["--steps", "40"], metric=metric, workdir=tmp_path, live=False, console=Console(file=out, width=200))
        for view, value in zip(swarm.views, values, strict=True):
            view.first_step_s, view.step, view.metric_value = 1.0, 20, value
        swarm._print_progress([0.0])
        assert out.getvalue().rstrip().endswith(f"steps 20–20 {best}"), out.getvalue()
        Console(file=out, width=200).print(swarm._table())
        header = next(line for line in out.getvalue().splitlines() if "peer" in line)
        assert [c.strip() for c in header.split("┃")[4:-3]] == ["train loss", *metric.columns], header
