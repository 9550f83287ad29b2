"""How long healthy trainers stall when one trainer is SIGKILLed or frozen (SIGSTOP), on this machine.

Starts a bootstrap and N trainers (`phalanx join --mode sync`, digits-mlp) on 127.0.0.1, polls each
trainer's /api/v1/status once a second, and then, one fault at a time: SIGKILLs a trainer's main
process (only that one, as the OOM killer does), restarts it under the same --identity-path, or
freezes its whole process group for --stop-s seconds. A healthy trainer's stall is the longest time
its step did not move while a fault was under way. Prints one line per fault and a summary.

    python scripts/measure_stalls.py --kills 8 --stops 3
    python scripts/measure_stalls.py --kills 8 --stops 3 -- --part-idle-timeout-s 0   # the old behaviour

Arguments after `--` go to every `phalanx join`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Trainer:
    name: str
    args: list[str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    steps: list[tuple[float, int]] = field(default_factory=list)  # (time, step) whenever the step moved
    status: dict = field(default_factory=dict)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", *self.args, "--http-port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"), start_new_session=True,
            env={**os.environ, "PHALANX_TORCH_THREADS": "1"},
        )  # fmt: skip

    def poll(self) -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/status", timeout=0.8) as r:
                self.status = json.loads(r.read())
        except (OSError, ValueError):
            return
        step = self.status.get("step") or 0
        if not self.steps or step != self.steps[-1][1]:
            self.steps.append((time.monotonic(), step))

    def stalled_s(self, start: float, end: float) -> float:
        """Longest time in [start, end] without a step change."""
        moves = [t for t, _ in self.steps if start <= t <= end]
        marks = [start, *moves, end]
        return max(b - a for a, b in zip(marks, marks[1:]))

    def kill_group(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainers", type=int, default=4)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--stops", type=int, default=3)
    ap.add_argument("--stop-s", type=float, default=20.0)
    ap.add_argument("--watch-s", type=float, default=25.0, help="how long each fault is watched")
    ap.add_argument("join_args", nargs="*")
    opts = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="phalanx-stalls-"))
    boot = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(scratch / "b.id")],
        stdout=subprocess.PIPE, stderr=open(scratch / "bootstrap.log", "wb"), text=True, start_new_session=True,
    )  # fmt: skip
    trainers: list[Trainer] = []
    stop_polling = threading.Event()
    try:
        initial = next(line.split()[1] for line in boot.stdout if line.startswith("--initial-peers"))
        for i in range(opts.trainers):
            args = [
                "join", "--initial-peers", initial, "--host-maddrs", LOOPBACK, "--mode", "sync",
                "--task", "digits-mlp", "--identity-path", str(scratch / f"t{i}.id"), "--eval-every", "1000000",
                "--wait-for-peers", str(opts.trainers), *opts.join_args,
            ]  # fmt: skip
            trainers.append(Trainer(f"t{i}", args, free_port(), scratch / f"t{i}.log"))
            trainers[-1].start()

        def poller() -> None:
            while not stop_polling.is_set():
                for t in trainers:
                    t.poll()
                stop_polling.wait(1.0)

        threading.Thread(target=poller, daemon=True).start()
        wait_until(lambda: all(t.steps and t.steps[-1][1] >= 20 for t in trainers), 300, "every trainer at step 20")
        faults = [("kill", i) for i in range(opts.kills)] + [("stop", i) for i in range(opts.stops)]
        worst: dict[str, float] = {}
        for n, (kind, i) in enumerate(faults):
            victim = trainers[1 + n % (len(trainers) - 1)]  # t0 stays up throughout
            others = [t for t in trainers if t is not victim]
            start = time.monotonic()
            if kind == "kill":
                os.kill(victim.proc.pid, signal.SIGKILL)
                victim.proc.wait()
                time.sleep(opts.watch_s)
            else:
                os.killpg(victim.proc.pid, signal.SIGSTOP)
                time.sleep(opts.stop_s)
                os.killpg(victim.proc.pid, signal.SIGCONT)
                time.sleep(opts.watch_s)
            end = time.monotonic()
            stall = max(t.stalled_s(start, end) for t in others)
            worst[kind] = max(worst.get(kind, 0.0), stall)
            extra = ""
            if kind == "kill":  # its helpers must be gone, so the same identity starts again
                victim.steps.clear()
                victim.start()
                came_up = wait_until(lambda: len(victim.steps) >= 2, 180, f"{victim.name} restarted", fail=False)
                extra = f"; restarted under its identity: {'yes' if came_up else 'NO'}"
            print(f"{kind} {victim.name}: healthy trainers' longest stall {stall:.1f} s{extra}", flush=True)
            wait_until(lambda: all(len(t.steps) >= 2 and time.monotonic() - t.steps[-1][0] < 5 for t in trainers), 180,
                       "every trainer stepping again", fail=False)  # fmt: skip
        for t in trainers:
            t.poll()
            r = t.status.get("rounds", {})
            print(f"{t.name}: rounds ok {r.get('ok')} partial {r.get('partial')} failed {r.get('failed')} "
                  f"resync {r.get('resync')} members dropped idle {r.get('members_dropped_idle')} late "
                  f"{r.get('members_dropped_late')} parts dropped idle {r.get('parts_dropped_idle')}")  # fmt: skip
        print("longest stall: " + ", ".join(f"{k} {v:.1f} s" for k, v in worst.items()))
    finally:
        stop_polling.set()
        for t in trainers:
            t.kill_group()
        os.killpg(boot.pid, signal.SIGKILL)
        boot.wait()
        print(f"logs in {scratch}")


def wait_until(condition, timeout_s: float, what: str, fail: bool = True) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            if fail:
                raise SystemExit(f"timed out waiting for {what}")
            print(f"(timed out waiting for {what})", flush=True)
            return False
        time.sleep(0.5)
    return True


if __name__ == "__main__":
    main()
