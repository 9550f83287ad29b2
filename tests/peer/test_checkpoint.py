"""Checkpoints: round trip, fallback past damaged files, retention, and SIGKILL at every point of a save."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.peer.checkpoint import Checkpoint, checkpoint_path, load_latest, save_checkpoint

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _trained_model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(2):  # two steps: momentum buffers exist and are not just the first gradient
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=generator)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _save_step(directory: Path, step: int, **kwargs: object) -> Path:
    return save_checkpoint(
        directory,
        step=step,
        model_state={"w": torch.full((4,), float(step))},
        optimizer_state={"state": {}, "param_groups": []},
        extra={"step": step},
        **kwargs,  # type: ignore[arg-type]
    )


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name[5:14]) for p in directory.glob("ckpt-*.pt"))


def test_round_trip_restores_parameters_momentum_and_step(tmp_path: Path) -> None:
    model, optimizer = _trained_model_and_optimizer()
    extra = {"peer_id": "peer-a", "lr": 0.1, "history": [0.5, 0.25], "meta": {"round": 3, "ok": True, "x": None}}
    path = save_checkpoint(
        tmp_path, step=1234, model_state=model.state_dict(), optimizer_state=optimizer.state_dict(), extra=extra
    )
    assert path == tmp_path / "ckpt-000001234.pt" == checkpoint_path(tmp_path, 1234)

    ckpt = load_latest(tmp_path)
    assert isinstance(ckpt, Checkpoint) and ckpt.step == 1234 and ckpt.path == path and ckpt.extra == extra
    fresh_model, fresh_optimizer = _trained_model_and_optimizer(seed=1)
    fresh_model.load_state_dict(ckpt.model_state)
    fresh_optimizer.load_state_dict(ckpt.optimizer_state)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(optimizer.state[a]["momentum_buffer"], fresh_optimizer.state[b]["momentum_buffer"])
    assert fresh_optimizer.param_groups[0]["weight_decay"] == 1e-4


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    assert load_latest(tmp_path / "never-created") is None
    assert load_latest(tmp_path) is None


def test_truncated_newest_falls_back_to_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for step in (1, 2, 3):
        _save_step(tmp_path, step)
    newest = checkpoint_path(tmp_path, 3)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="phalanx.peer.checkpoint"):
        ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 2 and torch.equal(ckpt.model_state["w"], torch.full((4,), 2.0))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"skipping unreadable checkpoint {newest}"]


def test_every_damaged_file_is_skipped(tmp_path: Path) -> None:
    _save_step(tmp_path, 1)
    checkpoint_path(tmp_path, 2).write_bytes(b"")  # empty
    checkpoint_path(tmp_path, 3).write_bytes(b"garbage" * 100)  # not a zip
    _save_step(tmp_path, 4, keep=10)
    os.rename(checkpoint_path(tmp_path, 4), checkpoint_path(tmp_path, 5))  # named for another step
    torch.save({"format": "something-else"}, checkpoint_path(tmp_path, 6))
    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 1


class _Exploit:
    """Unpickling this would create a file; weights_only loading must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (self.marker,))


def test_arbitrary_objects_are_never_unpickled(tmp_path: Path) -> None:
    _save_step(tmp_path, 1)
    marker = tmp_path / "pwned"
    payload = {"format": "phalanx-checkpoint", "version": 1, "step": 2, "model": {}, "optimizer": {}, "extra": {}}
    payload["extra"]["x"] = _Exploit(marker)
    torch.save(payload, checkpoint_path(tmp_path, 2))
    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 1
    assert not marker.exists()


def test_leftover_temp_files_are_ignored_and_removed(tmp_path: Path) -> None:
    _save_step(tmp_path, 1)
    dead_writer = tmp_path / ".ckpt-000000002.2147483647.abc123.tmp"  # pid beyond any pid_max
    dead_writer.write_bytes(b"half a checkpoint")
    odd = tmp_path / ".ckpt-garbage.tmp"
    odd.write_bytes(b"")
    own = tmp_path / f".ckpt-000000003.{os.getpid()}.xyz.tmp"  # maybe a save running on another thread
    own.write_bytes(b"in progress")
    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 1
    assert not dead_writer.exists() and not odd.exists() and own.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([own.name, "ckpt-000000001.pt"])


def test_retention_keeps_newest_k(tmp_path: Path) -> None:
    for step in range(1, 7):
        _save_step(tmp_path, step)
    assert _steps(tmp_path) == [4, 5, 6]
    _save_step(tmp_path, 7, keep=1)
    assert _steps(tmp_path) == [7]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000007.pt"]  # no temp files remain


def test_a_checkpoint_supersedes_those_of_higher_steps(tmp_path: Path) -> None:
    """A peer that trained alone to step 12 while cut off, then took the swarm's state of step 6: resuming
    must continue from 6, not from the state it left (nor from a damaged file of a later step)."""
    for step in (10, 11, 12):
        _save_step(tmp_path, step)
    checkpoint_path(tmp_path, 13).write_bytes(b"damaged leftover of a later step")
    _save_step(tmp_path, 6, keep=2)
    assert _steps(tmp_path) == [6]
    _save_step(tmp_path, 7, keep=2)
    _save_step(tmp_path, 8, keep=2)
    assert _steps(tmp_path) == [7, 8]
    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 8


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint keep=0 must be at least 1 \(the checkpoint just written\)$"):
        _save_step(tmp_path, 1, keep=0)
    with pytest.raises(TypeError) as info:
        save_checkpoint(tmp_path, step=1, model_state={}, optimizer_state={}, extra={"loss": [np.float64(0.5)]})
    assert str(info.value) == (
        "checkpoint extra['loss'][0] is a float64; only str, int, float, bool, None, tensors, "
        "lists, tuples and dicts of those can be saved"
    )
    assert list(tmp_path.iterdir()) == []  # nothing written


# --- crashes: checkpoint writers SIGKILLed at chosen points of a save, and at arbitrary moments ------
#
# One child process (sys.executable) imports torch once and forks a writer per scenario, so
# the whole table costs one interpreter start. Each writer saves steps 1, 2, ... into its own
# folder; a scenario either makes the writer SIGKILL itself at a point of the save of
# CRASH_STEP (deterministic), or lets the launcher SIGKILL it after it reported N saves
# (arbitrary: whatever the writer was doing then, the assertions must hold).

LAUNCHER = r'''
import io, os, signal, sys, traceback
import torch
from phalanx.peer.checkpoint import save_checkpoint

torch.set_num_threads(1)  # no worker threads exist when we fork
root, crash_step, scenarios = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
launcher = os.getpid()


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def crash_at(point, step):
    """Patch the writer so that the save of `step` dies at `point`."""
    real_save, real_replace = torch.save, os.replace

    def crash_before(module, name):
        real = getattr(module, name)

        def patched(*args, **kwargs):
            if step[0] == crash_step:
                die()
            return real(*args, **kwargs)

        setattr(module, name, patched)

    if point == "mid-write":  # half the bytes of the temp file are written, then the crash
        def half_save(obj, f, *args, **kwargs):
            if step[0] != crash_step:
                return real_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            die()
        torch.save = half_save
    elif point == "before-fsync":  # temp file complete but neither synced nor renamed
        crash_before(os, "fsync")
    elif point == "before-replace":  # temp file synced, not renamed
        crash_before(os, "replace")
    elif point == "after-replace":  # renamed; directory not synced, old files not pruned
        def replace_then_die(*args, **kwargs):
            real_replace(*args, **kwargs)
            if step[0] == crash_step:
                die()
        os.replace = replace_then_die
    elif point == "mid-prune":  # new file in place, about to delete the oldest
        crash_before(os, "unlink")
    else:
        raise SystemExit(f"unknown crash point {point}")


def write_forever(directory, step, report_fd):
    while os.getppid() == launcher and step[0] < 10_000:  # stop if the launcher is gone
        step[0] += 1
        save_checkpoint(
            directory,
            step=step[0],
            model_state={"w": torch.full((100_000,), float(step[0]))},  # 400 kB: writes take real time
            optimizer_state={"state": {0: {"momentum_buffer": torch.full((10,), float(step[0]))}}, "param_groups": []},
            extra={"step": step[0]},
            keep=3,
        )
        if report_fd is not None:
            os.write(report_fd, b"%d\n" % step[0])


for scenario in scenarios:
    point, _, kill_after = scenario.partition("@")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        os.close(read_fd)
        try:
            step = [0]
            if point != "arbitrary":
                crash_at(point, step)
            write_forever(os.path.join(root, scenario), step, write_fd)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(3)  # only reached if the writer was not killed
    os.close(write_fd)
    reported = 0
    with os.fdopen(read_fd, "rb") as reports:
        for line in reports:
            reported = int(line)
            if point == "arbitrary" and reported == int(kill_after):
                os.kill(pid, signal.SIGKILL)  # the writer is somewhere in its next save, or between saves
                break
    _, status = os.waitpid(pid, 0)
    print(scenario, os.waitstatus_to_exitcode(status), reported, flush=True)
'''

CRASH_STEP = 5
# Crash point → newest step that must load afterwards, and the steps on disk before the next save.
CRASH_POINTS = {
    "mid-write": (4, [2, 3, 4]),
    "before-fsync": (4, [2, 3, 4]),
    "before-replace": (4, [2, 3, 4]),
    "after-replace": (5, [2, 3, 4, 5]),
    "mid-prune": (5, [2, 3, 4, 5]),
}
ARBITRARY = ["arbitrary@1", "arbitrary@3", "arbitrary@4", "arbitrary@8"]


@pytest.fixture(scope="module")
def crashes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, int]]:
    """Scenario → (its folder, the writer's exit code, the last step it reported saved)."""
    root = tmp_path_factory.mktemp("crashes")
    script = root / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    # On timeout, run() kills the launcher; its writers notice the launcher is gone and stop.
    done = subprocess.run(
        [sys.executable, str(script), str(root), str(CRASH_STEP), *CRASH_POINTS, *ARBITRARY],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    results = {}
    for line in done.stdout.splitlines():
        scenario, exit_code, reported = line.split()
        results[scenario] = (root / scenario, int(exit_code), int(reported))
    assert sorted(results) == sorted([*CRASH_POINTS, *ARBITRARY]), done.stdout + done.stderr
    return results


def _check_whole(ckpt: Checkpoint | None, at_least: int) -> Checkpoint:
    assert ckpt is not None and ckpt.step >= at_least
    assert torch.equal(ckpt.model_state["w"], torch.full((100_000,), float(ckpt.step)))
    assert torch.equal(ckpt.optimizer_state["state"][0]["momentum_buffer"], torch.full((10,), float(ckpt.step)))
    assert ckpt.extra == {"step": ckpt.step}
    return ckpt


@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_sigkill_during_save_loses_nothing_saved(point: str, crashes: dict[str, tuple[Path, int, int]]) -> None:
    directory, exit_code, reported = crashes[point]
    assert exit_code == -signal.SIGKILL, f"the writer was not killed at {point}"
    assert reported == CRASH_STEP - 1
    newest, steps_on_disk = CRASH_POINTS[point]

    ckpt = _check_whole(load_latest(directory), at_least=newest)
    assert ckpt.step == newest
    assert _steps(directory) == steps_on_disk
    assert not list(directory.glob(".ckpt-*.tmp"))  # the dead writer's temp file was removed

    # Training resumes: the next save works and retention catches up.
    _save_step(directory, ckpt.step + 1)
    assert _steps(directory) == [ckpt.step - 1, ckpt.step, ckpt.step + 1]


@pytest.mark.parametrize("scenario", ARBITRARY)
def test_sigkill_at_an_arbitrary_moment(scenario: str, crashes: dict[str, tuple[Path, int, int]]) -> None:
    """Whatever the writer was doing when killed, load_latest returns a whole checkpoint, at least the last reported."""
    directory, exit_code, reported = crashes[scenario]
    assert exit_code == -signal.SIGKILL and reported == int(scenario.split("@")[1])
    _check_whole(load_latest(directory), at_least=reported)  # never raises, never loses a reported save
    assert len(_steps(directory)) <= 4  # keep=3, plus one if the kill came between rename and prune
    assert not list(directory.glob(".ckpt-*.tmp"))
