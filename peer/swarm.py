"""`phalanx swarm`: a whole swarm on this machine — one bootstrap and N trainer processes on
loopback — with live progress, a final report and cleanup of everything it started.

Each process runs in its own session so that its DHT process and p2pd daemon can be
killed with it; Ctrl-C stops the trainers gracefully (they checkpoint), then kills
whatever is left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table

from aggregation.errors import PhalanxError

logger = logging.getLogger(__name__)
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass
class PeerView:
    """What the launcher knows of one trainer, from its JSON events."""

    name: str
    process: Optional[asyncio.subprocess.Process] = None
    peer_id: str = ""
    step: int = 0
    loss: Optional[float] = None
    accuracy: Optional[float] = None
    group: int = 0
    bytes_sent: int = 0
    report: Optional[dict[str, Any]] = None
    exit_code: Optional[int] = None
    attack: Optional[str] = None
    extra_args: list[str] = field(default_factory=list)  # this peer's own flags (e.g. a straggler's --slowdown)
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SwarmResult:
    reached_target: bool
    wall_s: float
    time_to_target_s: Optional[float]
    peers: list[PeerView]
    best_accuracy: Optional[float]


class Swarm:
    def __init__(
        self,
        peers: int,
        join_args: list[str],
        *,
        target_accuracy: Optional[float],
        workdir: Optional[Path] = None,
        console: Optional[Console] = None,
        live: bool = True,
        join_env: Optional[dict[str, str]] = None,
        attacks: Optional[list[str]] = None,
        stragglers: int = 0,
        straggler_args: Optional[list[str]] = None,
    ) -> None:
        if peers < 1:
            raise PhalanxError("--peers must be at least 1")
        attacks = attacks or []
        if len(attacks) >= peers:
            raise PhalanxError("--byzantine must leave at least one honest peer")
        self.n = peers
        self.join_args = join_args
        self.target_accuracy = target_accuracy
        self.own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="phalanx-swarm-")) if workdir is None else workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console(stderr=True)
        self.live = live
        self.join_env = join_env or {}
        self.bootstrap: Optional[asyncio.subprocess.Process] = None
        # the last len(attacks) trainers are Byzantine, one attack each
        honest = peers - len(attacks)
        if stragglers > honest:
            raise PhalanxError("--stragglers cannot exceed the honest peers")
        self.views = [PeerView(f"trainer-{i}") for i in range(honest - stragglers)]
        self.views += [PeerView(f"straggler-{i}", extra_args=list(straggler_args or [])) for i in range(stragglers)]
        self.views += [PeerView(f"byzantine-{i}", attack=a) for i, a in enumerate(attacks)]
        self.started = time.monotonic()
        self.time_to_target: Optional[float] = None
        self.target_hit = asyncio.Event()
        self.logs: list[Any] = []

    def _command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "peer.cli", *args]

    async def _spawn(self, name: str, args: list[str], env_extra: dict[str, str]) -> asyncio.subprocess.Process:
        log = open(self.workdir / f"{name}.log", "wb")
        self.logs.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
        return await asyncio.create_subprocess_exec(
            *self._command(*args),
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env=env,
            start_new_session=True,  # its DHT process and p2pd die with its process group
        )

    async def _start_bootstrap(self) -> list[str]:
        self.bootstrap = await self._spawn(
            "bootstrap",
            ["bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(self.workdir / "bootstrap.id")],
            {},
        )
        while True:
            line = await asyncio.wait_for(self.bootstrap.stdout.readline(), timeout=120)
            if not line:
                raise PhalanxError(f"bootstrap peer exited early; see {self.workdir / 'bootstrap.log'}")
            text = line.decode().strip()
            if text.startswith("--initial-peers "):
                return [text.split(maxsplit=1)[1]]

    async def _start_trainer(self, view: PeerView, initial_peers: list[str]) -> None:
        args = [
            "join",
            "--initial-peers", *initial_peers,
            "--host-maddrs", LOOPBACK,
            "--identity-path", str(self.workdir / f"{view.name}.id"),
            "--events",
            *self.join_args,
            *(["--attack", view.attack] if view.attack else []),
            *view.extra_args,
        ]  # fmt: skip
        env = {"PHALANX_TORCH_THREADS": "1"} if "--torch-threads" not in self.join_args else {}
        view.process = await self._spawn(view.name, args, {**env, **self.join_env})

    async def _follow(self, view: PeerView) -> None:
        assert view.process is not None and view.process.stdout is not None
        async for line in view.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            view.events.append(event)
            kind = event.get("event")
            if kind == "started":
                view.peer_id, view.step = event["peer_id"], event["step"]
            elif kind == "step":
                view.step, view.loss, view.group = event["step"], event["loss"], event["group"]
                view.bytes_sent = event.get("bytes_sent", view.bytes_sent)
            elif kind == "eval":
                view.step, view.accuracy = event["step"], event["accuracy"]
                honest = view.attack is None  # a banned attacker may train on alone: only honest peers count
                if honest and self.target_accuracy is not None and event["accuracy"] >= self.target_accuracy:
                    if self.time_to_target is None:
                        self.time_to_target = time.monotonic() - self.started
                    self.target_hit.set()
            elif kind == "resynced":
                view.step = event["step"]
            elif kind == "done":
                view.report = event
        view.exit_code = await view.process.wait()

    def _table(self) -> Table:
        table = Table(title=f"phalanx swarm — {time.monotonic() - self.started:.1f} s", expand=False)
        for col in ("peer", "id", "step", "loss", "accuracy", "group", "sent"):
            table.add_column(col, justify="right" if col not in ("peer", "id") else "left")
        for v in self.views:
            table.add_row(
                v.name,
                v.peer_id[-8:],
                str(v.step),
                "" if v.loss is None else f"{v.loss:.4f}",
                "" if v.accuracy is None else f"{v.accuracy:.4f}",
                str(v.group or ""),
                f"{v.bytes_sent / 1e6:.2f} MB",
            )
        return table

    async def run(self) -> SwarmResult:
        followers: list[asyncio.Task] = []
        target_task: Optional[asyncio.Task] = None
        try:
            initial_peers = await self._start_bootstrap()
            for view in self.views:
                await self._start_trainer(view, initial_peers)
                followers.append(asyncio.create_task(self._follow(view)))
            target_task = asyncio.create_task(self.target_hit.wait())
            waiting = {target_task, *followers}

            async def wait_a_bit(timeout: float) -> bool:
                """True once the target is hit or every trainer has exited."""
                await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                return target_task.done() or all(f.done() for f in followers)

            if self.live and self.console.is_terminal:
                with Live(self._table(), console=self.console, refresh_per_second=4) as live:
                    while not await wait_a_bit(0.25):
                        live.update(self._table())
                    live.update(self._table())
            else:
                last = time.monotonic()
                while not await wait_a_bit(1.0):
                    if time.monotonic() - last > 5:
                        last = time.monotonic()
                        steps = [v.step for v in self.views]
                        accs = [v.accuracy for v in self.views if v.accuracy is not None]
                        best = f"{max(accs):.4f}" if accs else "n/a"
                        self.console.print(
                            f"[{time.monotonic() - self.started:6.1f} s] steps {min(steps)}–{max(steps)} best accuracy {best}"
                        )
            target_task.cancel()
            await self._stop_trainers(grace_s=30)
            await asyncio.wait(followers, timeout=60)  # stragglers are killed in _cleanup
        finally:
            if target_task is not None:
                target_task.cancel()
            await self._cleanup(followers)
        accs = [v.accuracy for v in self.views if v.accuracy is not None and v.attack is None]
        return SwarmResult(
            reached_target=self.target_hit.is_set(),
            wall_s=time.monotonic() - self.started,
            time_to_target_s=self.time_to_target,
            peers=self.views,
            best_accuracy=max(accs) if accs else None,
        )

    async def _stop_trainers(self, grace_s: float) -> None:
        procs = [v.process for v in self.views if v.process is not None and v.process.returncode is None]
        for p in procs:  # the trainer alone: it shuts its DHT process and daemon down itself
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        if procs:
            await asyncio.wait([asyncio.create_task(p.wait()) for p in procs], timeout=grace_s)

    async def _cleanup(self, followers: list[asyncio.Task]) -> None:
        procs = [v.process for v in self.views if v.process is not None]
        if self.bootstrap is not None:
            procs.append(self.bootstrap)
        for p in procs:
            if p.returncode is None:
                _signal_group(p, signal.SIGTERM)
        if procs:
            await asyncio.wait([asyncio.create_task(p.wait()) for p in procs], timeout=15)
        for p in procs:
            _signal_group(p, signal.SIGKILL)  # the group: DHT processes and p2pd daemons too
            if p.returncode is None:
                await p.wait()
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for log in self.logs:
            log.close()
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _bans(banned: list[str], attackers: set[str]) -> str:
    if not banned:
        return ""
    caught = sum(p in attackers for p in banned)
    return f"{len(banned)} ({caught} attackers)" if attackers else str(len(banned))


def _signal_group(process: asyncio.subprocess.Process, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def print_report(result: SwarmResult, console: Console, target: Optional[float]) -> None:
    table = Table(title="final report")
    attackers = {v.peer_id for v in result.peers if v.attack}
    for col in ("peer", "id", "steps", "accuracy", "rounds ok", "partial", "failed", "resyncs", "sent MB", "banned", "exit"):
        table.add_column(col, justify="left" if col in ("peer", "id", "banned") else "right")
    for v in result.peers:
        r = v.report or {}
        table.add_row(
            v.name,
            v.peer_id[-8:],
            str(r.get("step", v.step)),
            "" if v.accuracy is None else f"{v.accuracy:.4f}",
            str(r.get("rounds_ok", "")),
            str(r.get("rounds_partial", "")),
            str(r.get("rounds_failed", "")),
            str(r.get("resyncs", "")),
            f"{r.get('bytes_sent', v.bytes_sent) / 1e6:.2f}",
            _bans(r.get("banned", []), attackers),
            "" if v.exit_code is None else str(v.exit_code),
        )
    console.print(table)
    if attackers:
        kinds = ", ".join(sorted({v.attack for v in result.peers if v.attack}))
        console.print(f"banned: how many peers each one saw banned, and how many of those are the {len(attackers)} attackers ({kinds})")
    best = "n/a" if result.best_accuracy is None else f"{result.best_accuracy:.4f}"
    line = f"wall time {result.wall_s:.1f} s, best test accuracy {best}"
    if target is not None:
        if result.reached_target:
            line += f", reached {target} after {result.time_to_target_s:.1f} s"
        else:
            line += f", target {target} NOT reached"
    console.print(line)


def run_swarm(
    peers: int,
    join_args: list[str],
    *,
    target_accuracy: Optional[float],
    workdir: Optional[Path],
    attacks: Optional[list[str]] = None,
    stragglers: int = 0,
    straggler_args: Optional[list[str]] = None,
) -> SwarmResult:
    import uvloop

    console = Console(stderr=True)
    if not console.is_terminal:
        console.width = 120  # logs and CI: do not squeeze the report into 80 columns
    swarm = Swarm(
        peers, join_args, target_accuracy=target_accuracy, workdir=workdir, console=console, attacks=attacks,
        stragglers=stragglers, straggler_args=straggler_args,
    )  # fmt: skip

    async def main() -> SwarmResult:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        return await swarm.run()

    try:
        result = uvloop.run(main())
    except asyncio.CancelledError:
        console.print("interrupted: every process of the swarm was stopped")
        raise KeyboardInterrupt from None
    print_report(result, console, target_accuracy)
    return result
