"""Trainers as real `phalanx join` processes on loopback: newcomers, resume, the swarm command."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.peer.checkpoint import load_latest
from tests.peer.trainer_procs import join_args
from tests.procs import children, spawn_events, unix_socket_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _checkpoints(directory: Path) -> dict[int, Path]:
    return {int(p.stem.split("-")[1]): p for p in directory.glob("ckpt-*.pt")}


def test_newcomer_downloads_state_and_matches_the_others(bootstrap, tmp_path):
    # A checkpoint of every step, so that each holds one of the steps whose round had all three (a peer
    # left out of a few rounds resyncs and skips steps).
    common = ("--steps", "1000000", "--eval-every", "1000000", "--checkpoint-every", "1", "--checkpoint-keep", "1000")
    procs = []
    try:
        for name in ("a", "b"):
            args = join_args(bootstrap, tmp_path, name, *common, "--wait-for-peers", "2", "--checkpoint-dir", str(tmp_path / name))
            procs.append(spawn_events(args, tmp_path / f"{name}.log"))
        for p in procs:
            p.next_event("step", where=lambda e: e["step"] >= 20)
        newcomer = spawn_events(
            join_args(bootstrap, tmp_path, "c", *common, "--checkpoint-dir", str(tmp_path / "c")), tmp_path / "c.log"
        )
        procs.append(newcomer)
        resynced = newcomer.next_event("resynced")
        joined_at = resynced["step"]
        assert joined_at > 20
        together = set()  # steps whose round had all three: each ended it with the same model
        for p in procs:  # all three train together for a while, and each has been in a round of all three
            together.add(p.next_event("step", where=lambda e: e["step"] >= joined_at + 30 and e["group"] == 3)["step"])
        sockets = set.union(*(unix_socket_files(p.popen.pid) for p in procs))
        assert any("p2pclient" in s.name for s in sockets) and any("p2pd" in s.name for s in sockets), sockets
        for p in procs:
            p.send()
        for p in procs:
            p.stop()
        assert not [s for s in sockets if s.exists()], "a stopped peer left its sockets' files behind"
        for name in "abc":  # stopping with its daemon is routine, not an error with a traceback
            log = (tmp_path / f"{name}.log").read_text()
            assert not re.findall(r"^\d\d:\d\d:\d\d E .*", log, re.M), log[-3000:]
        # Not the last common checkpoint: all three stop at once, and the round in flight then is partial
        # (each daemon gets the signal too), each member missing different parts, so its models differ.
        for step in sorted(together):
            states = [torch.load(_checkpoints(tmp_path / n)[step], weights_only=True) for n in "abc"]
            for name in states[0]["model"]:
                assert torch.equal(states[0]["model"][name], states[2]["model"][name]), (step, name)
                assert torch.equal(states[1]["model"][name], states[2]["model"][name]), (step, name)
            momentum = [s["optimizer"]["state"][0]["momentum_buffer"] for s in states]
            assert torch.equal(momentum[0], momentum[2]) and torch.equal(momentum[1], momentum[2]), step
    finally:
        for p in procs:
            p.kill()


def test_resume_restores_identical_parameters(bootstrap, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = spawn_events(join_args(bootstrap, tmp_path, "p", "--steps", "30", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"), tmp_path / "1.log")
    done = first.next_event("done")
    assert first.popen.wait(60) == 0
    assert done["step"] == 30 and load_latest(ckpt).step == 30

    again = spawn_events(join_args(bootstrap, tmp_path, "p", "--steps", "40", "--checkpoint-dir", str(ckpt), "--resume"), tmp_path / "2.log")
    started = again.next_event("started")
    assert started["step"] == 30 and started["param_hash"] == done["param_hash"]
    finished = again.next_event("done")
    assert finished["step"] == 40 and again.popen.wait(60) == 0


def test_trainer_whose_dht_process_dies_says_so_and_exits(bootstrap, tmp_path):
    # before, it trained on alone, and a thread blocked on the dead DHT kept it from ever exiting
    ckpt = tmp_path / "ckpt"
    proc = spawn_events(join_args(bootstrap, tmp_path, "p", "--steps", "100000000", "--checkpoint-dir", str(ckpt)), tmp_path / "p.log")
    sockets: set[Path] = set()
    try:
        proc.next_event("training")
        sockets = unix_socket_files(proc.popen.pid)
        dht_processes = children(proc.popen.pid)
        assert dht_processes, "the trainer has no child process"
        for pid in dht_processes:
            os.kill(pid, signal.SIGKILL)
        assert proc.popen.wait(120) == 1, proc.tail()
        done = proc.next_event("done")
        assert "the DHT process died" in proc.tail()
        assert load_latest(ckpt).step == done["step"] > 0
        assert not [s for s in sockets if "p2pclient" in s.name and s.exists()], "the trainer left its socket file"
    finally:
        proc.kill()
        for leftover in sockets:  # p2pd's, whose DHT process was killed
            leftover.unlink(missing_ok=True)


def test_swarm_command_reaches_target_and_cleans_up(tmp_path):
    workdir = tmp_path / "swarm"
    result = subprocess.run(
        [sys.executable, "-m", "phalanx", "swarm", "--peers", "2", "--steps", "600", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reached 0.95" in result.stderr
    assert "final report" in result.stderr
    # every process the swarm started is gone
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(workdir) not in ps
