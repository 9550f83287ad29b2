"""The zygote forks peers that behave as `phalanx <argv>` started afresh: their own arguments,
environment, stdout pipe, log, session and exit code, and none of them outlives the zygote's close."""

import asyncio
import json
import os
import signal
import socket
import time

import pytest
from hivemind.utils.mpfuture import MPFuture, SharedBytes

from phalanx.security.identity import Identity
from phalanx.tools.launcher.zygote import Zygote, own_locks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 100))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_fork_runs_the_cli_with_its_own_arguments_environment_pipe_and_log(tmp_path):
    async def main():
        zygote = Zygote(tmp_path / "zygote.log")
        await zygote.start()
        try:
            helped = await zygote.spawn(["bootstrap", "--help"], {"COLUMNS": "80"}, tmp_path / "help.log")
            usage = (await helped.stdout.read()).decode()
            # the environment is the one given, not the zygote's: a bad PHALANX_* value is named
            wrong = await zygote.spawn(["join"], {"PHALANX_STEPS": "many"}, tmp_path / "wrong.log")
            return usage, await helped.wait(), await wrong.wait(), (await wrong.stdout.read())
        finally:
            await zygote.aclose()

    usage, help_code, wrong_code, wrong_out = _run(main())
    assert help_code == 0 and "Usage: phalanx bootstrap" in usage
    assert wrong_code == 2 and wrong_out == b""
    lines = (tmp_path / "wrong.log").read_text().strip().splitlines()
    assert len(lines) == 1 and "PHALANX_STEPS" in lines[0], lines  # the one-line error, in its own log
    assert "Traceback" not in (tmp_path / "zygote.log").read_text()


def test_forks_lead_their_own_sessions_and_closing_the_zygote_stops_them(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on: the trainer waits for its initial peer
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    peer = Identity.generate_ed25519(tmp_path / "absent.id").peer_id
    argv = ["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}", "--initial-peers-wait-s", "90",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path", str(tmp_path / "me.id")]  # fmt: skip

    async def main():
        zygote = Zygote(tmp_path / "zygote.log")
        await zygote.start()
        first = await zygote.spawn(argv, dict(os.environ), tmp_path / "first.log")
        second = await zygote.spawn(argv[:-1] + [str(tmp_path / "other.id")], dict(os.environ), tmp_path / "second.log")
        sessions = (os.getsid(first.pid), os.getsid(second.pid))
        first.send_signal(signal.SIGKILL)
        killed = await first.wait()
        assert second.returncode is None
        await zygote.aclose()  # stops the second one, still waiting for its initial peer
        return first.pid, second.pid, sessions, killed, await second.wait()

    first, second, sessions, killed, stopped = _run(main())
    assert sessions == (first, second)
    assert killed == -signal.SIGKILL
    assert stopped != 0 and not _alive(second)


def test_a_fork_takes_hivemind_locks_of_its_own():
    """hivemind's MPFuture locks are made at import: forks of one zygote shared them, so 32 trainers and
    their DHT processes queued on one semaphore for every future, and a peer killed while holding it would
    have stopped every other. The zygote holds its lock here; its fork makes a future regardless."""
    held = SharedBytes._lock
    held.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # a zygote's fork, before it runs the CLI
            code = 1
            try:
                own_locks()
                MPFuture()  # takes SharedBytes' lock: with the zygote's, it waits for ever
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while not (finished := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the fork waited for the zygote's lock")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(finished[1]) == 0
    finally:
        held.release()


def test_a_fork_runs_a_script_as_python_would_with_its_arguments_cwd_and_threads(tmp_path):
    """The tests' helper scripts (a user's loop on `phalanx.Optimizer`) run as forks too: `python <script>`'s
    argv and sys.path[0], the working directory asked for, stderr beside stdout, OMP_NUM_THREADS honoured."""
    from tests.procs import start_script, wait_scripts

    script = tmp_path / "scripts" / "show.py"
    script.parent.mkdir()
    script.write_text(
        "import json, os, sys, torch\n"
        "print('to stderr', file=sys.stderr, flush=True)\n"
        "print(json.dumps([sys.argv, sys.path[0], os.getcwd(), torch.get_num_threads()]))\n"
    )
    (tmp_path / "work").mkdir()
    log = tmp_path / "show.log"
    proc = start_script([str(script), "--flag", "x y"], log, cwd=tmp_path / "work")
    wait_scripts([proc], [log])
    lines = log.read_text().splitlines()
    assert lines[0] == "to stderr"
    argv, path0, cwd, threads = json.loads(lines[1])
    assert argv == [str(script), "--flag", "x y"] and path0 == str(script.parent)
    assert cwd == str(tmp_path / "work") and threads == 1
