"""A real swarm in a fault lab: a bootstrap and trainers, each `phalanx` process on its own network
host, every peer's `/api/v1/status` polled once a second from a thread inside its namespace.

The polls are the measurement: steps, rounds by outcome, group size, readiness. "Same model" is
read from the trainers' checkpoints: in sync mode peers at one step of one swarm hold identical
parameters, so their checkpoints of that step hash the same.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from phalanx.tools.lab.forks import ForkedPopen
from phalanx.tools.lab.hosts import Lab
from phalanx.tools.lab.procs import alive, descendants

P2P_PORT, DIRECT_PORT, HTTP_PORT = 31337, 31338, 9100
POLL_S = 1.0
PEER_DEBUG_ENV = "FAULT_TABLE_DEBUG"  # set: the swarm's peers run with --debug (scripts/faults.py --debug)


@dataclass(frozen=True)
class Sample:
    """One poll of a peer's /api/v1/status (`ok` False: no answer within 2 s)."""

    t: float  # time.monotonic()
    ok: bool
    step: int = 0
    rounds_ok: int = 0
    rounds_partial: int = 0
    rounds_failed: int = 0
    group: int = 0
    ready: bool = False
    reasons: tuple[str, ...] = ()
    accuracy: Optional[float] = None
    peers_seen: int = 0
    reachability: str = ""  # direct, punched, relay or client
    bans: tuple[str, ...] = ()  # peers it has banned

    @property
    def rounds_done(self) -> int:
        return self.rounds_ok + self.rounds_partial


def longest_stall(samples: list[Sample], t0: float, t1: float) -> float:
    """Longest interval in [t0, t1] in which the polled step did not increase."""
    times, last = [t0], None
    for s in samples:
        if s.ok and t0 <= s.t <= t1:
            if last is not None and s.step > last:
                times.append(s.t)
            last = s.step
    times.append(t1)
    return max(b - a for a, b in zip(times, times[1:]))


def read_status(timeout_s: float = 2.0) -> Optional[dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=timeout_s)
    try:
        conn.request("GET", "/api/v1/status")
        reply = conn.getresponse()
        return json.loads(reply.read())
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def to_sample(t: float, status: Optional[dict[str, Any]]) -> Sample:
    if status is None:
        return Sample(t, False)
    rounds = status.get("rounds", {})
    return Sample(
        t, True, step=int(status.get("step", 0)),
        rounds_ok=int(rounds.get("ok", 0)), rounds_partial=int(rounds.get("partial", 0)),
        rounds_failed=int(rounds.get("failed", 0)), group=int(rounds.get("last_group_size", 0)),
        ready=bool(status.get("ready")), reasons=tuple(status.get("not_ready_because", ()))[:4],
        accuracy=status.get("accuracy"), peers_seen=int(status.get("peers_seen", 0)),
        reachability=str(status.get("reachability", "")), bans=tuple(status.get("bans", ())),
    )  # fmt: skip


@dataclass
class Peer:
    name: str
    role: str  # "bootstrap" or "trainer"
    args: list[str]
    log: Path
    checkpoints: Optional[Path] = None
    proc: Optional[subprocess.Popen | ForkedPopen] = None
    started_at: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    tree: list[int] = field(default_factory=list)  # main process and its descendants, when last looked

    def between(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.samples if t0 <= s.t <= t1]

    def last(self) -> Optional[Sample]:
        answered = [s for s in self.samples if s.ok]
        return answered[-1] if answered else None


class LabSwarm:
    """Bootstrap host "boot", trainers "t1".."tN", spare hosts for newcomers; `close()` ends all."""

    def __init__(
        self,
        workdir: Path,
        trainers: int = 4,
        spare: int = 0,
        join_args: tuple[str, ...] = (),
        tag: str = "s",
        homes: tuple[str, ...] = (),
        symmetric: tuple[str, ...] = (),
        checkpoints: bool = True,
    ) -> None:
        """`homes`: trainers (by name) each behind a home router of its own, nobody able to dial them;
        `symmetric`: those of them whose router's NAT is symmetric; `checkpoints`: every 10 steps, each
        kept (the fault tests' "same model"), or none (benchmarks)."""
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = checkpoints
        self.trainer_names = [f"t{i}" for i in range(1, trainers + 1)]
        self.spare_names = [f"n{i}" for i in range(1, spare + 1)]
        self.join_args = list(join_args)
        public = [n for n in ("boot", *self.trainer_names, *self.spare_names) if n not in homes]
        self.lab = Lab(public, tag=tag)
        try:
            for name in homes:
                self.lab.add_home(name, symmetric=name in symmetric)
        except BaseException:
            self.lab.close()
            raise
        self.peers: dict[str, Peer] = {}
        self._stop = threading.Event()
        self._pollers: list[threading.Thread] = []
        self.boot_maddr = ""

    # ---- processes ------------------------------------------------------------------------

    def maddr(self, name: str, peer_id: str) -> str:
        return f"/ip4/{self.lab[name].ip}/tcp/{P2P_PORT}/p2p/{peer_id}"

    def identity(self, name: str) -> tuple[Path, str]:
        from phalanx.security.identity import Identity

        path = self.workdir / f"{name}.id"
        identity = Identity.load(path) if path.exists() else Identity.generate_ed25519(path)
        return path, identity.peer_id

    def _spawn(self, peer: Peer) -> None:
        host = self.lab[peer.name]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PHALANX_TORCH_THREADS": "1"}
        peer.proc = host.fork_phalanx(peer.args, env, peer.log, self.workdir)
        peer.started_at = time.monotonic()
        if not any(t.name == f"{host.name}-poll" for t in self._pollers):
            self._pollers.append(host.thread_in(lambda: self._poll(peer), "poll"))

    def _poll(self, peer: Peer) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            peer.samples.append(to_sample(began, read_status()))
            self._stop.wait(max(0.0, POLL_S - (time.monotonic() - began)))

    def start_bootstrap(self) -> None:
        identity, peer_id = self.identity("boot")
        host = self.lab["boot"]
        debug = ["--debug"] if os.environ.get(PEER_DEBUG_ENV) else []
        args = [*debug, "bootstrap", "--host-maddrs", f"/ip4/{host.ip}/tcp/{P2P_PORT}", "--identity-path", str(identity), "--http-port", str(HTTP_PORT)]
        self.boot_maddr = self.maddr("boot", peer_id)
        self.peers["boot"] = peer = Peer("boot", "bootstrap", args, self.workdir / "boot.log")
        self._spawn(peer)

    def trainer_args(self, name: str, initial_peers: list[str], *extra: str) -> list[str]:
        identity, _ = self.identity(name)
        host = self.lab[name]
        return [
            *(["--debug"] if os.environ.get(PEER_DEBUG_ENV) else []), "join", "--initial-peers", ",".join(initial_peers), "--host-maddrs", f"/ip4/{host.ip}/tcp/{P2P_PORT}",
            "--direct-port", str(DIRECT_PORT), "--identity-path", str(identity), "--http-port", str(HTTP_PORT),
            "--task", "digits-mlp",
            *(("--checkpoint-dir", str(self.workdir / f"{name}.ckpt"), "--checkpoint-every", "10", "--checkpoint-keep", "100000")
              if self.checkpoints else ()),
            # started beside each other, as the launcher and compose start theirs: a first dial that fails on a
            # loaded machine (a home's through its router, in a CI run) is tried again, not the trainer's end
            "--initial-peers-wait-s", "60", *self.join_args, *extra,
        ]  # fmt: skip

    def start_trainer(self, name: str, initial_peers: Optional[list[str]] = None, *extra: str) -> Peer:
        args = self.trainer_args(name, initial_peers or [self.boot_maddr], *extra)
        self.peers[name] = peer = Peer(name, "trainer", args, self.workdir / f"{name}.log", self.workdir / f"{name}.ckpt")
        self._spawn(peer)
        return peer

    def restart(self, name: str) -> None:
        """Start a trainer again with its identity, checkpoints and --resume (a volunteer's restart)."""
        peer = self.peers[name]
        if "--resume" not in peer.args:
            peer.args.append("--resume")
        self._spawn(peer)

    def start(self, wait_for: int = 0) -> None:
        self.start_bootstrap()
        self.wait(lambda: self.answering("boot"), 120, "the bootstrap never answered its status")
        extra = ["--wait-for-peers", str(len(self.trainer_names))]
        for name in self.trainer_names:
            self.start_trainer(name, None, *extra)

    def answering(self, name: str) -> bool:
        last = self.peers[name].samples[-1:] if name in self.peers else []
        return bool(last) and last[0].ok

    def wait(self, condition, timeout_s: float, what: str) -> float:
        """Poll `condition` each 0.2 s; returns when it held, raises with `what` (and logs) after `timeout_s`."""
        began = time.monotonic()
        while not condition():
            if time.monotonic() - began > timeout_s:
                raise AssertionError(f"{what} within {timeout_s:.0f} s\n{self.log_tails()}")
            for peer in self.peers.values():
                if peer.proc is not None and peer.proc.poll() is not None and peer.role == "bootstrap":
                    raise AssertionError(f"the bootstrap exited ({peer.proc.returncode})\n{self.log_tails()}")
            time.sleep(0.2)
        return time.monotonic() - began

    def training_together(self, names: Optional[list[str]] = None, min_step: int = 1, group: int = 0) -> bool:
        """Every one of `names` past `min_step`, its last round with `group` members (0: all of `names`)."""
        names = names or self.trainer_names
        lasts = [self.peers[n].last() for n in names]
        return all(s is not None and s.group >= (group or len(names)) and s.step >= min_step for s in lasts)

    # ---- faults on processes ----------------------------------------------------------------

    def signal_main(self, name: str, sig: int) -> None:
        peer = self.peers[name]
        peer.tree = [peer.proc.pid, *descendants(peer.proc.pid)]
        os.kill(peer.proc.pid, sig)

    def signal_tree(self, name: str, sig: int) -> None:
        peer = self.peers[name]
        peer.tree = [peer.proc.pid, *descendants(peer.proc.pid)]
        for pid in peer.tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def survivors(self, name: str) -> list[int]:
        """Processes of `name`'s last signalled tree that still live."""
        return [pid for pid in self.peers[name].tree if alive(pid)]

    def reap(self, name: str) -> None:
        """Kill what is left of a trainer (its group and the tree noted when it was signalled)."""
        peer = self.peers[name]
        for pid in self.survivors(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(peer.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        peer.proc.wait()

    # ---- checkpoints ------------------------------------------------------------------------

    def checkpoint_hashes(self, name: str, since_wall: float = 0.0) -> dict[int, str]:
        """{step: hash of the model's parameters} of `name`'s checkpoints written after `since_wall` (time.time())."""
        import torch

        hashes = {}
        folder = self.peers[name].checkpoints
        for path in sorted(folder.glob("ckpt-*.pt")) if folder and folder.exists() else []:
            step = int(path.stem.split("-")[1])
            try:
                if path.stat().st_mtime < since_wall:
                    continue
            except FileNotFoundError:
                continue
            try:
                model = torch.load(path, map_location="cpu", weights_only=True)["model"]
            except Exception as e:  # a corrupt file is a finding, not a crash of the harness
                hashes[step] = f"unreadable: {type(e).__name__}"
                continue
            h = hashlib.sha256()
            for key in sorted(model):
                h.update(key.encode())
                h.update(model[key].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            hashes[step] = h.hexdigest()[:16]
        return hashes

    def same_model(self, names: list[str], since_wall: float) -> tuple[int, list[int]]:
        """(steps all of `names` checkpointed, in order; those at which their parameters differed), over
        checkpoints written after `since_wall`."""
        tables = [self.checkpoint_hashes(n, since_wall) for n in names]
        common = sorted(set.intersection(*(set(t) for t in tables))) if tables else []
        return common, [step for step in common if len({t[step] for t in tables}) > 1]

    # ---- teardown ---------------------------------------------------------------------------

    def log_tails(self, chars: int = 1500) -> str:
        out = []
        for peer in self.peers.values():
            text = peer.log.read_text(errors="replace")[-chars:] if peer.log.exists() else ""
            out.append(f"--- {peer.name} ---\n{text}")
        return "\n".join(out)

    def stop(self, name: str, timeout_s: float = 20.0) -> None:
        """SIGTERM one peer's process group (a clean leave), SIGKILL what is left after `timeout_s`."""
        proc = self.peers[name].proc
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def stop_all(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every live process group (trainers write their final checkpoint), then SIGKILL."""
        for peer in self.peers.values():
            if peer.proc is not None and peer.proc.poll() is None:
                try:
                    os.killpg(peer.proc.pid, signal.SIGCONT)
                    os.killpg(peer.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for peer in self.peers.values():
            if peer.proc is not None:
                try:
                    peer.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    def dump_samples(self) -> None:
        """Every poll of every peer as JSON lines in the work folder (t relative to the first poll)."""
        t0 = min((p.samples[0].t for p in self.peers.values() if p.samples), default=0.0)
        with open(self.workdir / "samples.jsonl", "w") as out:
            for peer in self.peers.values():
                for s in list(peer.samples):
                    out.write(json.dumps({"peer": peer.name, **asdict(s), "t": round(s.t - t0, 2)}) + "\n")

    def close(self) -> None:
        self._stop.set()
        try:
            self.stop_all()
            self.dump_samples()
        finally:
            for thread in self._pollers:
                thread.join(timeout=5)
            self.lab.close()
