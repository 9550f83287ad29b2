"""What an attacker costs the honest trainers of a live swarm on this machine, against the same swarm unattacked.

Starts a bootstrap and trainers (`phalanx join --mode sync`, digits-mlp) on 127.0.0.1 and reads each
trainer's /api/v1/status once a second. Two scenarios (docs/threat-model.md):

  oversized  one more trainer declares 1 GiB for every part it sends (and with --verify also signs it),
             against a clean run with an honest trainer in its place: the honest trainers' peak RSS and
             steps/s, the most rounds in a row the attacker took part in, and whether it was banned.
  flood      N TCP connections opened to one trainer's direct data port and held open: that trainer's
             open descriptors, and every trainer's steps/s before and during the flood.
  sybils     an outsider's DHT node keeps N membership records of made-up peers alive, each signed by a
             key of its own: how many peers the trainers see, their steps/s, and how soon the records lapse.

    python scripts/measure_attacks.py oversized --trainers 3 --window-s 40
    python scripts/measure_attacks.py oversized --trainers 3 --window-s 40 --verify
    python scripts/measure_attacks.py flood --connections 5000
    python scripts/measure_attacks.py sybils --records 20

Arguments after `--` go to every `phalanx join`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.security.identity import Identity

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
JOINER = Path(__file__).resolve().parents[1] / "tests" / "adversary" / "oversized_joiner.py"
VERIFY = ["--aggregator", "centered_clip", "--tau", "1", "--verify"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Peer:
    name: str
    command: list[str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    status: dict = field(default_factory=dict)
    peer_id: str = ""
    groups: list[int] = field(default_factory=list)  # members of each round, from its step events

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *self.command, "--http-port", str(self.port), "--events"],
            stdout=subprocess.PIPE, stderr=open(self.log, "ab"), text=True, start_new_session=True,
            env={**os.environ, "PHALANX_TORCH_THREADS": "1"},
        )  # fmt: skip
        threading.Thread(target=self._events, daemon=True).start()

    def _events(self) -> None:
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "step":
                    self.groups.append(event["group"])

    def poll(self) -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/status", timeout=0.8) as r:
                self.status = json.loads(r.read())
        except (OSError, ValueError):
            pass

    @property
    def step(self) -> int:
        return self.status.get("step") or 0

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.contextmanager
def swarm(scratch: Path, honest: int, join_args: list[str], attacker: list[str] | None = None, first: list[str] = ()):
    """Bootstrap + `honest` trainers (+ a patched one run as `attacker` + the join command); `first`: flags of trainer 0 only."""
    boot = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(scratch / "b.id")],
        stdout=subprocess.PIPE, stderr=open(scratch / "bootstrap.log", "wb"), text=True, start_new_session=True,
    )  # fmt: skip
    peers: list[Peer] = []
    stop = threading.Event()
    try:
        initial = next(line.split()[1] for line in boot.stdout if line.startswith("--initial-peers"))
        count = honest + (attacker is not None)
        for i in range(count):
            name = f"t{i}" if i < honest else "attacker"
            join = [
                "join", "--initial-peers", initial, "--host-maddrs", LOOPBACK, "--mode", "sync", "--task", "digits-mlp",
                "--identity-path", str(scratch / f"{name}.id"), "--eval-every", "1000000", "--wait-for-peers", str(count),
                *join_args, *(first if i == 0 else ()),
            ]  # fmt: skip
            command = ["-m", "phalanx", *join] if i < honest else [*attacker[:1], *join, *attacker[1:]]
            peers.append(Peer(name, command, free_port(), scratch / f"{name}.log"))
            peers[-1].peer_id = Identity.generate_ed25519(scratch / f"{name}.id").peer_id
            peers[-1].start()

        def poller() -> None:
            while not stop.is_set():
                for p in peers:
                    p.poll()
                stop.wait(1.0)

        threading.Thread(target=poller, daemon=True).start()
        yield peers[:honest], (peers[honest] if attacker is not None else None), initial
    finally:
        stop.set()
        for p in peers:
            p.stop()
        os.killpg(boot.pid, signal.SIGKILL)
        boot.wait()


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def steps_per_s(peers: list[Peer], window_s: float) -> list[float]:
    before = [p.step for p in peers]
    time.sleep(window_s)
    return [(p.step - b) / window_s for p, b in zip(peers, before)]


def longest_run(groups: list[int], members: int) -> int:
    longest = run = 0
    for g in groups:
        run = run + 1 if g == members else 0
        longest = max(longest, run)
    return longest


def oversized(opts, scratch: Path) -> None:
    args = ["--compression", "fp16", *(VERIFY if opts.verify else []), *opts.join_args]
    results = {}
    for case in ("clean", "attacked"):
        attacker = [str(JOINER), *(["--attack", "oversized_part"] if opts.verify else [])] if case == "attacked" else None
        honest = opts.trainers + (case == "clean")  # the clean run has an honest trainer in the attacker's place
        with swarm(scratch / case, honest, args, attacker) as (trainers, bad, _):
            wait_until(lambda: all(t.step >= 20 for t in trainers), 300, f"{case}: every honest trainer at step 20")
            rates = steps_per_s(trainers[: opts.trainers], opts.window_s)
            watched = trainers[: opts.trainers]
            results[case] = {
                "steps/s": statistics.mean(rates),
                "peak RSS MiB": max(t.peak_rss_mib() for t in watched),
                "rounds with the attacker in a row": max(longest_run(t.groups, opts.trainers + 1) for t in watched) if bad else 0,
                "banned by": sum(bool(bad and bad.peer_id in t.status.get("bans", [])) for t in watched),
            }
        print(f"{case}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in results[case].items()), flush=True)
    clean, attacked = results["clean"], results["attacked"]
    print(
        f"honest trainers under attack: peak RSS {attacked['peak RSS MiB'] / clean['peak RSS MiB']:.2f}x of the clean run "
        f"(goal <= 1.2x), throughput {attacked['steps/s'] / clean['steps/s']:.2f}x (goal >= 0.8x); the attacker took part in "
        f"at most {attacked['rounds with the attacker in a row']} rounds in a row (goal <= 2)"
        + (f", banned by {attacked['banned by']} of {opts.trainers}" if opts.verify else "")
    )


def flood(opts, scratch: Path) -> None:
    port = free_port()
    with swarm(scratch, opts.trainers, opts.join_args, first=["--direct-port", str(port)]) as (trainers, _, _):
        wait_until(lambda: all(t.step >= 20 for t in trainers), 300, "every trainer at step 20")
        before, fds_before = steps_per_s(trainers, opts.window_s), trainers[0].open_fds()
        held: list[socket.socket] = []
        most_fds, refused = fds_before, 0
        try:
            for _ in range(opts.connections):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                held.append(s)
                if len(held) % 250 == 0:
                    most_fds = max(most_fds, trainers[0].open_fds())
            started = time.monotonic()
            rates_during = []
            while time.monotonic() - started < opts.window_s:
                most_fds = max(most_fds, trainers[0].open_fds())
                rates_during.append(steps_per_s(trainers, 2.0))
            during = [statistics.mean(r[i] for r in rates_during) for i in range(len(trainers))]
            refused = trainers[0].status.get("transport", {}).get("direct_refused", "n/a")
        finally:
            for s in held:
                s.close()
        print(f"{opts.connections} connections held on t0's data port: its open descriptors {fds_before} before, "
              f"at most {most_fds} during; refused by its caps: {refused}")  # fmt: skip
        for t, b, d in zip(trainers, before, during):
            print(f"{t.name}: {b:.1f} steps/s before, {d:.1f} during ({d / b:.2f}x)")


def sybils(opts, scratch: Path) -> None:
    import hivemind
    from hivemind.utils import get_dht_time

    from phalanx.protocol.membership import PeerRecord
    from phalanx.security.records import sign_record

    with swarm(scratch, opts.trainers, opts.join_args) as (trainers, _, initial):
        wait_until(lambda: all(t.step >= 20 for t in trainers), 300, "every trainer at step 20")
        before = steps_per_s(trainers, opts.window_s)
        status = trainers[0].status
        key = f"phalanx.{status['run_id']}.{status['config_hash'][:16]}.peers"
        fakes = [Identity.generate_ed25519(scratch / f"sybil-{i}.id") for i in range(opts.records)]
        attacker = hivemind.DHT(initial_peers=[initial], host_maddrs=[LOOPBACK], start=True)
        stop, seen = threading.Event(), []

        def publish() -> None:  # what an outsider holding the keys does: re-sign each record every 10 s
            while not stop.is_set():
                for fake in fakes:
                    value, expiration = sign_record(fake, key, PeerRecord(state="online", step=10**6), signed_at=get_dht_time(), ttl_s=30)
                    attacker.store(key, value, expiration, subkey=fake.peer_id, return_future=True)
                seen.append(max(t.status.get("peers_seen", 0) for t in trainers))
                stop.wait(10.0)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        try:
            wait_until(lambda: min(t.status.get("peers_seen", 0) for t in trainers) >= opts.trainers + opts.records, 120, "the records seen")
            during = steps_per_s(trainers, opts.window_s)
        finally:
            stop.set()
            publisher.join()
            attacker.shutdown()
        stopped = time.monotonic()
        wait_until(lambda: all(t.status.get("peers_seen") == opts.trainers for t in trainers), 300, "the records lapsed")
        print(f"{opts.records} signed records re-signed every 10 s: trainers saw up to {max(seen)} peers; gone "
              f"{time.monotonic() - stopped:.0f} s after the last signature")  # fmt: skip
        for t, b, d in zip(trainers, before, during):
            print(f"{t.name}: {b:.1f} steps/s before, {d:.1f} during ({d / b:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["oversized", "flood", "sybils"])
    ap.add_argument("--trainers", type=int, default=3, help="honest trainers")
    ap.add_argument("--window-s", type=float, default=30.0, help="how long throughput is measured")
    ap.add_argument("--verify", action="store_true", help="oversized: verified rounds (the attacker signs its size)")
    ap.add_argument("--connections", type=int, default=5000, help="flood: connections held open")
    ap.add_argument("--records", type=int, default=20, help="sybils: membership records of made-up peers, validly signed")
    ap.add_argument("join_args", nargs="*")
    opts = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix=f"phalanx-{opts.scenario}-"))
    for case in ("clean", "attacked"):
        (scratch / case).mkdir()
    try:
        {"oversized": oversized, "flood": flood, "sybils": sybils}[opts.scenario](opts, scratch)
    finally:
        print(f"logs in {scratch}")


if __name__ == "__main__":
    main()
