"""Scenario (g): kill -9 of a lone trainer at seeded random moments while it checkpoints every
step, then `--resume`; every checkpoint must stay readable and none that was complete may be lost."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path
from typing import Callable

from tests.faults.fault_table import Row, last_error
from tests.procs import LOOPBACK, PEER_ENV, zygote


def run_checkpoint_kills(workdir: Path, kills: int = 20, seed: int = 16, log: Callable[[str], None] = print) -> list[Row]:
    """One trainer alone, `--checkpoint-every 1`: SIGKILL its process group at a seeded random moment
    after it wrote a checkpoint since its start, `--resume`, `kills` times; then read every checkpoint.

    Alone it needs no lab host: it listens on loopback, and each start is a fork of the test zygote (a
    fresh interpreter spends most of a restart importing torch and hivemind)."""
    import torch

    from phalanx.peer.checkpoint import load_latest
    from phalanx.security.identity import Identity

    rng = random.Random(seed)
    row = Row("g", f"kill -9 x{kills}, --checkpoint-every 1", kills=0, kills_mid_write=0, corrupt=0, missing=0)
    folder = workdir / "t1.ckpt"
    Identity.generate_ed25519(workdir / "t1.id")
    args = [
        "join", "--task", "digits-mlp", "--host-maddrs", LOOPBACK, "--http-port", "0", "--identity-path",
        str(workdir / "t1.id"), "--checkpoint-dir", str(folder), "--checkpoint-every", "1", "--checkpoint-keep", "3",
    ]  # fmt: skip
    proc = None
    try:
        for i in range(kills):
            expected = newest(folder)  # the newest complete checkpoint: what --resume must continue from
            peer_log = workdir / f"t1-{i}.log"  # a start of its own each, read from its beginning
            with open(workdir / f"t1-{i}.out", "wb") as out:
                proc = zygote().spawn([*args, *(["--resume"] if i else [])], {**os.environ, **PEER_ENV}, out.fileno(), peer_log)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and proc.poll() is None:
                if newest(folder) > expected and (expected < 0 or resumed_from(peer_log)):
                    break  # it resumed and is writing checkpoints again
                time.sleep(0.05)
            else:
                row.notes.append(f"kill {i}: no new checkpoint after the restart: {last_error(peer_log)}")
                break
            resumed = resumed_from(peer_log)
            if expected >= 0 and resumed[-1:] != [f"{expected:09d}"]:
                row.missing += 1
                row.notes.append(f"kill {i}: resumed from {resumed[-1:] or 'nothing'}, the newest checkpoint was {expected}")
            time.sleep(rng.uniform(0.0, 0.6))
            os.killpg(proc.pid, signal.SIGKILL)  # the trainer, its DHT process and p2pd
            proc.wait()
            row.kills += 1
            row.kills_mid_write += any(folder.glob(".ckpt-*.tmp"))
            for path in folder.glob("ckpt-*.pt"):
                try:
                    torch.load(path, map_location="cpu", weights_only=True)["model"]
                except Exception as e:
                    row.corrupt += 1
                    row.notes.append(f"kill {i}: {path.name} unreadable: {type(e).__name__}")
        latest = load_latest(folder)  # what a last --resume would read; it also removes the temp files
        if latest is None or latest.step != newest(folder):
            row.missing += 1
            row.notes.append(f"after the kills: load_latest gave {latest.step if latest else None}, newest file {newest(folder)}")
        row.notes.append(f"temp files left after load_latest: {len(list(folder.glob('.ckpt-*.tmp')))}")
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log(f"[g] {row.kills} kills, {row.kills_mid_write} left a temp file, {row.corrupt} corrupt, {row.missing} missing")
    return [row]


def resumed_from(log: Path) -> list[str]:
    """The checkpoint steps (as logged, 9 digits) a trainer resumed from in its log."""
    return re.findall(r"resumed from ckpt-(\d+)\.pt", log.read_text(errors="replace") if log.exists() else "")


def newest(folder: Path) -> int:
    steps = [int(p.stem.split("-")[1]) for p in folder.glob("ckpt-*.pt")] if folder.exists() else []
    return max(steps, default=-1)
