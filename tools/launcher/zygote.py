"""Start a local swarm's trainers as forks of one process that has already imported torch and hivemind.

A fresh `phalanx join` spends about 3 CPU-seconds importing torch and hivemind, and 1.5 more in
torch's optimizer machinery, before it does anything of its own; four of them side by side on two
cores were most of `phalanx swarm`'s time to the first step. The zygote pays that once, while it is
still single-threaded in Python, then forks one child per trainer. A child starts its own session,
takes the pipe and log the launcher gave it, and runs the same CLI `main` a fresh process would,
exiting through the interpreter's normal shutdown.

Protocol (one JSON object per message): the launcher sends requests on a socketpair,
``{"argv": [...], "env": {...}, "log": path}``, with the write end of the child's stdout pipe
attached (SCM_RIGHTS); optional: ``"script": path`` runs that Python script (`python <script> <argv>`)
instead of `phalanx <argv>`, ``"cwd": path`` its working directory, ``"netns": name`` runs it in that
network namespace (a lab host: `phalanx.tools.lab`), and ``"log": null`` sends its stderr to its stdout; the zygote answers on its stdout with ``{"ready": true}`` once it has
imported, ``{"pid": n}`` for each request once that child leads its own session, and ``{"exited": pid, "code": c}`` (negative: the signal)
as each child ends. When the launcher closes the socket the zygote stops what is left of its
children (SIGTERM to each child's process group, SIGKILL after STOP_GRACE_S) and exits. Once ready
it ignores SIGINT and SIGTERM, which Ctrl-C or a supervisor sends the launcher's whole process group:
stopping is the launcher's.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import multiprocessing
import os
import runpy
import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

from phalanx.errors import PhalanxError

# What a trainer imports before its first step, heaviest first (torch._dynamo: torch's optimizers load it
# at their first step). A module that fails to import is reported and left to the child.
PRELOAD = (
    "torch",
    "hivemind",
    "torch._dynamo",
    "phalanx.cli",
    "phalanx.peer.trainer",
    "phalanx.peer.node",
    "phalanx.peer.optimizer",
    "phalanx.tasks",
)
STOPPED_BY_LAUNCHER = (signal.SIGINT, signal.SIGTERM)  # sent to the launcher's process group: not the zygote's to act on
MAX_REQUEST = 1 << 20  # bytes of one request (argv, environment, log path)
STOP_GRACE_S = 10.0


def _say(message: dict[str, Any]) -> None:
    """One message to the launcher. os.write, not print: a buffered sys.stdout would be copied into
    every fork and flushed there, into the child's own pipe."""
    try:
        os.write(1, (json.dumps(message) + "\n").encode())
    except OSError:  # the launcher is gone: nobody is left to tell
        pass


def preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # the child imports it again and reports the error where it matters
            print(f"zygote: could not preload {name}: {e!r}", file=sys.stderr, flush=True)


def serve(control: socket.socket) -> Optional[dict[str, Any]]:
    """The zygote's loop. Returns only in a forked child: the request that child is to run."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
    # Ctrl-C reaches the launcher's whole process group, the zygote too: the launcher stops the peers (it
    # needs the zygote to hear them exit), then closes the socket, and the zygote ends with them
    for sig in STOPPED_BY_LAUNCHER:
        signal.signal(sig, signal.SIG_IGN)
    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    _say({"ready": True})
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                continue
            data, fds, _, _ = socket.recv_fds(control, MAX_REQUEST, 1)
            if not data:  # the launcher is gone or done
                _stop(children)
                return None
            request = json.loads(data)
            led_r, led_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setsid()  # its own process group: the launcher stops it, its DHT process and p2pd together
                selector.close()
                for fd in (wake_r, wake_w, control.fileno(), led_r, led_w):
                    os.close(fd)
                request["stdout_fd"] = fds[0]
                return request
            os.close(led_w)
            os.read(led_r, 1)  # EOF once the child leads its session: its pid is then also its group's
            os.close(led_r)
            os.close(fds[0])
            children.add(pid)
            _say({"pid": pid})
        _reap(children)


def _reap(children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _stop(children: set[int]) -> None:
    _reap(children)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in children:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while children and time.monotonic() < deadline:
            time.sleep(0.05)
            _reap(children)


def become(request: dict[str, Any]) -> None:
    """Turn this fork into the peer `request` describes, as `phalanx <argv>` would start; exits."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored signals stay ignored across exec)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stdout = request["stdout_fd"]
    log = os.dup(stdout) if request["log"] is None else os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (stdout, 1), (log, 2)):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("cwd"):
        os.chdir(request["cwd"])
    if request.get("netns"):  # before any socket: what it starts (its DHT process, p2pd) stays in there too
        from phalanx.tools.lab.procs import enter_netns

        enter_netns(request["netns"])
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered: events go out as they happen
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    script = request.get("script")
    if script is not None:
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python <script>` sets it, not the zygote's cwd
    for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):  # as a fresh interpreter reads it
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)
    _reseed()
    own_locks()
    _torch_threads()
    if script is None:
        sys.argv = ["phalanx", *request["argv"]]
        runpy.run_module("phalanx", run_name="__main__", alter_sys=True)  # `python -m phalanx <argv>`
        return
    sys.argv = [script, *request["argv"]]
    runpy.run_path(script, run_name="__main__")


def _torch_threads() -> None:
    """A fresh interpreter sizes torch's thread pool from OMP_NUM_THREADS when torch loads; a fork
    inherits the zygote's size, so set the child's own."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _reseed() -> None:
    """A fresh interpreter seeds numpy's global generator from the OS; a fork inherits the zygote's.
    (Python's `random` reseeds itself at fork; torch's default generator has a fixed seed either way.)"""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def own_locks() -> None:
    """hivemind's process-wide locks are class attributes made at import (multiprocessing semaphores): every
    fork shares the zygote's, so 32 trainers and their 32 DHT processes queued on one semaphore for each
    MPFuture they made (a trainer's dial-back check waited for the others' DHT starts), and one killed while
    holding it would stop every other. A fresh interpreter makes its own; so does a fork, here, before any
    future exists."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # its three locks, and the backend starts anew at the first future
    aio = sys.modules.get("hivemind.utils.asyncio")
    if aio is not None:
        aio._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


# ---- the launcher's side -------------------------------------------------------------------------


def control_pair() -> tuple[socket.socket, socket.socket]:
    """(ours, the zygote's) ends of its control socket. SEQPACKET keeps each request one message, its file
    descriptor with it."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def command(control_fd: int) -> list[str]:
    """The zygote's command line, given the descriptor of its end of the control socket (pass it on)."""
    return [sys.executable, "-m", "phalanx.tools.launcher.zygote", str(control_fd)]


class ForkedProcess:
    """A peer forked by the zygote, with what the launcher uses of `asyncio.subprocess.Process`."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, exited: asyncio.Future) -> None:
        self.pid = pid
        self.stdout = stdout
        self._exited = exited

    @property
    def returncode(self) -> Optional[int]:
        return self._exited.result() if self._exited.done() and not self._exited.exception() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


class Zygote:
    """Starts the zygote process (its imports run while the launcher goes on), forks peers from it,
    and stops it. Its own log holds what it says on stderr: preload failures, a crash."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._process: Optional[asyncio.subprocess.Process] = None
        self._control: Optional[socket.socket] = None
        self._ready = asyncio.Event()
        self._reader: Optional[asyncio.Task] = None
        self._pids: asyncio.Queue[int] = asyncio.Queue()
        self._exits: dict[int, asyncio.Future] = {}
        self._lock = asyncio.Lock()  # one request at a time: pids come back in request order

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def start(self) -> None:
        self._control, theirs = control_pair()
        with open(self.log_path, "wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                *command(theirs.fileno()), stdout=asyncio.subprocess.PIPE, stderr=log, pass_fds=(theirs.fileno(),)
            )
        theirs.close()
        self._reader = asyncio.create_task(self._read(), name="zygote-reader")

    def _exit(self, pid: int) -> asyncio.Future:
        if pid not in self._exits:
            self._exits[pid] = asyncio.get_running_loop().create_future()
        return self._exits[pid]

    async def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        async for line in self._process.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set()
            elif "pid" in message:
                self._pids.put_nowait(message["pid"])
            elif "exited" in message:
                future = self._exit(message["exited"])
                if not future.done():
                    future.set_result(message["code"])
        code = await self._process.wait()
        lost = PhalanxError(f"the zygote process exited with code {code} (log: {self.log_path})")
        for future in self._exits.values():
            if not future.done():
                future.set_exception(lost)

    async def spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess:
        """Fork a peer running `phalanx <argv>` with `env` as its whole environment."""
        assert self._reader is not None and self._control is not None
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait({ready, self._reader}, return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.is_set():
            ready.cancel()
            raise PhalanxError(f"the zygote process exited before it was ready (log: {self.log_path})")
        read_end, write_end = os.pipe()
        request = json.dumps({"argv": argv, "env": env, "log": str(log_path)}).encode()
        async with self._lock:
            try:
                socket.send_fds(self._control, [request], [write_end])
            finally:
                os.close(write_end)
            pid = await self._pids.get()
        stdout = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(read_end, "rb", buffering=0)
        )
        return ForkedProcess(pid, stdout, self._exit(pid))

    async def aclose(self, timeout_s: float = STOP_GRACE_S * 2 + 5) -> None:
        """Close the control socket: the zygote stops any child still running, then exits."""
        if self._control is not None:
            self._control.close()
        if self._process is not None:
            try:
                await asyncio.wait_for(self._process.wait(), timeout_s)
            except asyncio.TimeoutError:
                self._process.kill()
                await self._process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


if __name__ == "__main__":
    sys.stdout = sys.stderr  # stdout is the launcher's channel: whatever an import prints goes to the log
    preload()
    child = serve(socket.socket(fileno=int(sys.argv[1])))
    if child is None:
        sys.exit(0)
    become(child)
