"""`phalanx swarm`: a whole swarm on this machine — one bootstrap and N trainer processes on
loopback — with live progress, a final report and cleanup of everything it started.

Trainers are forked from one process that imported torch and hivemind once (tools/launcher/zygote.py), not
started as fresh interpreters that each import them. Each process runs in its own session so that
its DHT process and p2pd daemon can be killed with it; Ctrl-C stops the trainers gracefully (they checkpoint), then kills
whatever is left. Start-up is shown as it happens (from the trainers' JSON events); a peer
that exits early is reported with its log's last error line, the run stops once no honest
trainer is left, and the work folder of a failed run is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from phalanx.errors import PhalanxError
from phalanx.tasks.metric import ACCURACY, Metric
from phalanx.tools.launcher.report import exit_reason, is_failure, last_error_line, print_report
from phalanx.tools.launcher.views import PeerView, SwarmResult
from phalanx.tools.launcher.zygote import Zygote

logger = logging.getLogger(__name__)
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class Swarm:
    def __init__(
        self,
        peers: int,
        join_args: list[str],
        *,
        target: Optional[float] = None,
        metric: Metric = ACCURACY,
        workdir: Optional[Path] = None,
        console: Optional[Console] = None,
        live: bool = True,
        join_env: Optional[dict[str, str]] = None,
        attacks: Optional[list[str]] = None,
        stragglers: int = 0,
        straggler_args: Optional[list[str]] = None,
        debug: bool = False,
    ) -> None:
        if peers < 1:
            raise PhalanxError("--peers must be at least 1")
        attacks = attacks or []
        if len(attacks) >= peers:
            raise PhalanxError("--byzantine must leave at least one honest peer")
        self.n = peers
        self.join_args = join_args
        self.target, self.metric = target, metric  # the run stops once an honest trainer's evaluation reaches it
        self.own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="phalanx-swarm-")) if workdir is None else workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console(stderr=True)
        self.live = live
        self.join_env = join_env or {}
        self.debug = debug  # `phalanx --debug swarm`: the trainers' logs are verbose too
        self.bootstrap: Optional[asyncio.subprocess.Process] = None
        self.zygote = Zygote(self.workdir / "zygote.log")
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
        self.steps = _flag_value(join_args, "--steps")
        self.bootstrap_s: Optional[float] = None
        self.stopping = False  # set once the launcher stops the run: exits from then on are expected
        self._last_stage = ""

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "phalanx", *args]

    async def _spawn(self, name: str, args: list[str], env_extra: dict[str, str]) -> asyncio.subprocess.Process:
        log = open(self.workdir / f"{name}.log", "wb")
        self.logs.append(log)
        return await asyncio.create_subprocess_exec(
            *self._command(*args),
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env=self._env(env_extra),
            start_new_session=True,  # its DHT process and p2pd die with its process group
        )

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}

    def _identity(self, name: str) -> str:
        """An Ed25519 identity file for `name` in the work folder (kept if it is there). A missing file
        would make the peer generate an RSA key, and hivemind then starts a second p2p daemon at each
        start to check that no other peer uses an RSA identity: about a second per trainer here. Keys
        made by this launcher for its own peers cannot be in use elsewhere."""
        from phalanx.security.identity import Identity

        path = self.workdir / f"{name}.id"
        if not path.exists():
            Identity.generate_ed25519(path)
        return str(path)

    async def _start_bootstrap(self) -> list[str]:
        """Start the bootstrap on a port and identity chosen here, so its address is known at once and the
        trainers start beside it (they wait for it with --initial-peers-wait-s) instead of after it."""
        from phalanx.security.identity import Identity

        identity = self._identity("bootstrap")
        with socket.socket() as probe:  # a free loopback port for it
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.bootstrap = await self._spawn(
            "bootstrap",
            ["bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity-path", identity],
            {},
        )
        return [f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.load(identity).peer_id}"]

    async def _watch_bootstrap(self) -> None:
        """Until the bootstrap says it is up; an error naming its log if it exits before."""
        assert self.bootstrap is not None and self.bootstrap.stdout is not None
        log = self.workdir / "bootstrap.log"
        while True:
            line = await asyncio.wait_for(self.bootstrap.stdout.readline(), timeout=120)
            if not line:
                code = await self.bootstrap.wait()
                why = last_error_line(log) or "nothing in its log"
                raise PhalanxError(f"the bootstrap peer exited with code {code} before it was up: {why} (log: {log})")
            if line.decode().startswith("--initial-peers "):
                self.bootstrap_s = self._elapsed()
                return

    async def _start_trainer(self, view: PeerView, initial_peers: list[str]) -> None:
        args = [
            *(["--debug"] if self.debug else []),
            "join",
            "--initial-peers", *initial_peers,
            "--initial-peers-wait-s", "120",  # it starts beside the bootstrap
            "--host-maddrs", LOOPBACK,
            "--identity-path", self._identity(view.name),
            "--events",
            *self.join_args,
            *(["--attack", view.attack] if view.attack else []),
            *view.extra_args,
        ]  # fmt: skip
        env = {"PHALANX_TORCH_THREADS": "1"} if "--torch-threads" not in self.join_args else {}
        view.log_path = self.workdir / f"{view.name}.log"
        view.process = await self.zygote.spawn(args, self._env({**env, **self.join_env}), view.log_path)

    async def _follow(self, view: PeerView, initial_peers: list[str]) -> None:
        await self._start_trainer(view, initial_peers)
        assert view.process is not None and view.process.stdout is not None
        async for line in view.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            view.events.append(event)
            kind = event.get("event")
            if kind == "started":
                view.peer_id, view.step = event["peer_id"], event["step"]
                view.connected_s = self._elapsed()
            elif kind == "training":
                view.ready_s = self._elapsed()
            elif kind == "step":
                view.step, view.loss = event["step"], event["loss"]
                view.group = event.get("group", view.group)
                view.bytes_sent = event.get("bytes_sent", view.bytes_sent)
                if view.first_step_s is None:
                    view.first_step_s = self._elapsed()
            elif kind == "eval":
                view.step, view.metric_value = event["step"], event[self.metric.key]
                honest = view.attack is None  # a banned attacker may train on alone: only honest peers count
                if honest and self.target is not None and self.metric.reached(view.metric_value, self.target):
                    if self.time_to_target is None:
                        self.time_to_target = self._elapsed()
                    self.target_hit.set()
            elif kind == "outer":
                view.step, view.group = event["step"], event["group"]
            elif kind == "resynced":
                view.step = event["step"]
            elif kind == "done":
                view.report = event
        view.exit_code = await view.process.wait()
        if view.exit_code != 0 and view.log_path is not None:
            view.last_error = last_error_line(view.log_path)
        if not self.stopping:
            reason = exit_reason(view, steps=self.steps, swarm_reached_target=self.target_hit.is_set())
            style = "red" if is_failure(reason) else ""
            self.console.print(
                f"[{self._elapsed():6.1f} s] {view.name} exited with code {view.exit_code}: {reason} (log: {view.log_path})",
                style=style, markup=False, highlight=False, soft_wrap=True,
            )  # fmt: skip

    def startup(self) -> dict[str, Optional[float]]:
        """When every trainer had reached each start-up stage (None: not all of them did)."""

        def every(times: list[Optional[float]]) -> Optional[float]:
            return None if not times or None in times else max(times)  # type: ignore[type-var]

        first = [v.first_step_s for v in self.views if v.first_step_s is not None]
        return {
            "bootstrap up": self.bootstrap_s,
            "all on the DHT": every([v.connected_s for v in self.views]),
            "all see their peers": every([v.ready_s for v in self.views]),
            "first step": min(first) if first else None,
            "all training": every([v.first_step_s for v in self.views]),
        }

    def _stage(self) -> str:
        """One line: how far start-up got."""
        n = len(self.views)
        if self.bootstrap_s is None:
            return "starting the bootstrap peer…"
        if not self.zygote.ready:
            return "bootstrap up · importing torch for the trainers…"
        started = sum(v.process is not None for v in self.views)
        connected = sum(v.connected_s is not None for v in self.views)
        ready = sum(v.ready_s is not None for v in self.views)
        training = sum(v.first_step_s is not None for v in self.views)
        exited = sum(v.exit_code is not None for v in self.views)
        line = f"bootstrap up · {started}/{n} started · {connected}/{n} on the DHT · {ready}/{n} see peers · {training}/{n} training"
        return line + (f" · {exited} exited" if exited else "")

    def _starting(self) -> bool:
        return any(v.first_step_s is None and v.exit_code is None for v in self.views)

    def _table(self) -> Table:
        table = Table(title=f"phalanx swarm — {self._elapsed():.1f} s", expand=False)
        for col in ("peer", "id", "step", "train loss", *self.metric.columns, "group", "sent"):
            table.add_column(col, justify="right" if col not in ("peer", "id") else "left")
        for v in self.views:
            table.add_row(
                v.name,
                v.peer_id[-8:],
                str(v.step),
                "" if v.loss is None else f"{v.loss:.4f}",
                *self.metric.cells(v.metric_value),
                str(v.group or ""),
                f"{v.bytes_sent / 1e6:.2f} MB",
            )
        return table

    def _live_view(self) -> RenderableType:
        """The table, under it the start-up stage while some trainer has not taken a step."""
        return Group(self._table(), Text(self._stage())) if self._starting() else self._table()

    def _print_progress(self, last: list[float]) -> None:
        """Without a terminal: each change of the start-up stage, then a line every 5 s."""
        if self._starting():
            stage = self._stage()
            if stage != self._last_stage:
                self._last_stage = stage
                self.console.print(f"[{self._elapsed():6.1f} s] {stage}", markup=False, highlight=False)
            return
        if time.monotonic() - last[0] > 5:
            last[0] = time.monotonic()
            steps = [v.step for v in self.views]
            best = self.metric.best(v.metric_value for v in self.views if v.metric_value is not None)
            self.console.print(f"[{self._elapsed():6.1f} s] steps {min(steps)}–{max(steps)} best {self.metric.text(best)}")

    async def run(self) -> SwarmResult:
        followers: list[asyncio.Task] = []
        target_task: Optional[asyncio.Task] = None
        bootstrap_up: Optional[asyncio.Task] = None
        live = self.live and self.console.is_terminal
        failed = True  # until the run got to its end
        try:
            display = Live(get_renderable=self._live_view, console=self.console, refresh_per_second=4) if live else None
            with display if display is not None else contextlib.nullcontext():
                if not live:
                    self.console.print(f"starting a bootstrap peer and {self.n} trainers in {self.workdir}")
                initial_peers = await self._start_bootstrap()
                await self.zygote.start()  # its imports run beside the bootstrap's
                bootstrap_up = asyncio.create_task(self._watch_bootstrap())
                honest: list[asyncio.Task] = []
                for view in self.views:  # each starts as soon as the zygote is ready; progress shows meanwhile
                    followers.append(asyncio.create_task(self._follow(view, initial_peers)))
                    if view.attack is None:
                        honest.append(followers[-1])
                target_task = asyncio.create_task(self.target_hit.wait())
                waiting = {target_task, bootstrap_up, *followers}
                last = [time.monotonic()]

                async def wait_a_bit(timeout: float) -> bool:
                    """True once the target is hit or no honest trainer is left."""
                    await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                    if bootstrap_up.done():
                        bootstrap_up.result()  # raises if it exited before it was up
                        waiting.discard(bootstrap_up)
                    for f in followers:
                        if f.done() and f in waiting:
                            f.result()  # a follower that failed is a bug of ours: say so, not "the peer exited"
                    waiting.difference_update(f for f in followers if f.done())
                    return target_task.done() or all(f.done() for f in honest)

                while not await wait_a_bit(0.25 if live else 0.5):
                    if not live:
                        self._print_progress(last)
            if not target_task.done() and all(f.done() for f in honest) and not all(f.done() for f in followers):
                self.console.print("every honest trainer has exited: stopping the others")
            target_task.cancel()
            self.stopping = True
            await self._stop_trainers(grace_s=30)
            await asyncio.wait(followers, timeout=60)  # stragglers are killed in _cleanup
            failed = False
        finally:
            error = sys.exc_info()[1]  # what is unwinding the run, if anything
            self.stopping = True
            for task in (target_task, bootstrap_up):
                if task is not None:
                    task.cancel()
            await self._cleanup(followers)
            reasons = {
                v.name: exit_reason(v, steps=self.steps, swarm_reached_target=self.target_hit.is_set()) for v in self.views
            }
            failed = failed or any(is_failure(r) for r in reasons.values())
            if self.target is not None and not self.target_hit.is_set():
                failed = True
            honest_failed = any(is_failure(reasons[v.name]) for v in self.views if v.attack is None)
            interrupted = isinstance(error, asyncio.CancelledError)  # Ctrl-C: the user knows why
            kept = None
            if self.own_workdir:
                if failed and not interrupted:
                    kept = self.workdir
                else:
                    shutil.rmtree(self.workdir, ignore_errors=True)
            if kept is not None and error is not None:
                self.console.print(f"logs of this run are kept in {kept}", soft_wrap=True)
        return SwarmResult(
            reached_target=self.target_hit.is_set(),
            wall_s=self._elapsed(),
            time_to_target_s=self.time_to_target,
            peers=self.views,
            best=self.metric.best(v.metric_value for v in self.views if v.metric_value is not None and v.attack is None),
            metric=self.metric,
            target=self.target,
            succeeded=self.target_hit.is_set() if self.target is not None else not honest_failed,
            reasons=reasons,
            startup=self.startup(),
            kept_workdir=kept,
        )

    async def _stop_trainers(self, grace_s: float) -> None:
        procs = []
        for v in self.views:  # the trainer alone: it shuts its DHT process and daemon down itself
            if v.process is not None and v.process.returncode is None:
                v.stop_sent = True
                procs.append(v.process)
                try:
                    v.process.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        if procs:
            await asyncio.wait([asyncio.create_task(p.wait()) for p in procs], timeout=grace_s)

    async def _cleanup(self, followers: list[asyncio.Task]) -> None:
        procs = [v.process for v in self.views if v.process is not None]
        if self.bootstrap is not None:
            procs.append(self.bootstrap)
        for v in self.views:
            if v.process is not None and v.process.returncode is None:
                v.stop_sent = True
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
            if not task.done():
                await asyncio.wait([task], timeout=5)  # its process is gone: let it record the exit code
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for v in self.views:
            if v.exit_code is None and v.process is not None:
                v.exit_code = v.process.returncode
        await self.zygote.aclose()
        for log in self.logs:
            log.close()


def _flag_value(args: list[str], flag: str) -> Optional[int]:
    """The last integer value of `flag` in `args` (--flag N or --flag=N), or None."""
    value = None
    for i, arg in enumerate(args):
        text = args[i + 1] if arg == flag and i + 1 < len(args) else arg[len(flag) + 1 :] if arg.startswith(flag + "=") else None
        if text is not None:
            try:
                value = int(text)
            except ValueError:
                pass
    return value

def _signal_group(process: asyncio.subprocess.Process, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_swarm(
    peers: int,
    join_args: list[str],
    *,
    target: Optional[float],
    metric: Metric,
    workdir: Optional[Path],
    attacks: Optional[list[str]] = None,
    stragglers: int = 0,
    straggler_args: Optional[list[str]] = None,
    debug: bool = False,
) -> SwarmResult:
    import uvloop

    console = Console(stderr=True)
    if not console.is_terminal:
        console.width = 160  # logs and CI: do not squeeze the report into 80 columns
    swarm = Swarm(
        peers, join_args, target=target, metric=metric, workdir=workdir, console=console, attacks=attacks,
        stragglers=stragglers, straggler_args=straggler_args, debug=debug,
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
    print_report(result, console)
    return result
