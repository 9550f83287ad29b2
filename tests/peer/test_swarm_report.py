"""Why a swarm peer exited: the last error line of its log, its exit reason, the final table."""

import io
import signal

import pytest
from rich.console import Console

from phalanx.tools.launcher.report import exit_reason, is_failure, last_error_line, print_report, startup_line
from phalanx.tools.launcher.swarm import _flag_value
from phalanx.tools.launcher.views import PeerView, SwarmResult

TRACEBACK = """09:00:01 I peer.trainer: peer 12D3KooW training digits-mlp
Traceback (most recent call last):
  File "protocol/config.py", line 150, in verify_config_for
    return VerifyConfig(tau=values["tau"], eps=values.get("eps", 1e-6), **options)
                            ~~~~~~^^^^^^^
KeyError: 'tau'
"""


@pytest.mark.parametrize(
    "log, line",
    [
        (TRACEBACK, "KeyError: 'tau'"),
        ("09:00:01 I peer.trainer: hello\nerror: --tau: must be positive\n", "error: --tau: must be positive"),
        ("09:00:01 E peer.trainer: round failed\n09:00:02 I peer.trainer: stopping\n", "09:00:01 E peer.trainer: round failed"),
        (
            "hivemind.p2p.p2p_daemon_bindings.utils.P2PDaemonError: Daemon failed to start\n",
            "hivemind.p2p.p2p_daemon_bindings.utils.P2PDaemonError: Daemon failed to start",
        ),
        ('{"ts": 1, "level": "error", "msg": "boom"}\n{"ts": 2, "level": "info", "msg": "bye"}\n', '{"ts": 1, "level": "error", "msg": "boom"}'),
        ("09:00:01 I peer.trainer: nothing wrong here\n\n", "09:00:01 I peer.trainer: nothing wrong here"),
        ("", None),
    ],
)
def test_last_error_line(tmp_path, log, line):
    path = tmp_path / "peer.log"
    path.write_text(log)
    assert last_error_line(path) == line


def test_last_error_line_of_a_missing_log_is_none(tmp_path):
    assert last_error_line(tmp_path / "absent.log") is None


def _view(code, report=None, *, stop_sent=False, last_error=None):
    return PeerView("trainer-0", exit_code=code, report=report, stop_sent=stop_sent, last_error=last_error)


@pytest.mark.parametrize(
    "view, reached, reason",
    [
        (_view(0, {"reached_target": True, "step": 90}), True, "target reached"),
        (_view(3, {"reached_target": False, "step": 88}, stop_sent=True), True, "stopped: another peer reached the target"),
        (_view(3, {"reached_target": False, "step": 88}, stop_sent=True), False, "stopped by the launcher"),
        (_view(3, {"reached_target": False, "step": 600}), False, "steps done, target not reached"),
        (_view(0, {"reached_target": False, "step": 600}), False, "steps done"),
        (_view(0, {"reached_target": False, "step": 5}), False, "finished"),
        (_view(2, last_error="error: --task: no such task"), False, "error: --task: no such task"),
        (_view(1, {"step": 7}, last_error="KeyError: 'tau'"), False, "error: KeyError: 'tau'"),
        (_view(1), False, "error: exit code 1, nothing in its log"),
        (_view(-signal.SIGKILL), False, "killed by SIGKILL"),
        (_view(-signal.SIGKILL, stop_sent=True), False, "killed by SIGKILL (it did not stop in time)"),
        (_view(-signal.SIGTERM), False, "killed by SIGTERM"),
        (_view(-signal.SIGTERM, stop_sent=True), False, "stopped by the launcher (SIGTERM, before it was up)"),
        (_view(None), False, "still running"),
    ],
)
def test_exit_reason(view, reached, reason):
    assert exit_reason(view, steps=600, swarm_reached_target=reached) == reason


def test_failures_are_errors_and_kills():
    assert is_failure("error: KeyError: 'tau'") and is_failure("killed by SIGKILL")
    assert not any(map(is_failure, ("target reached", "steps done", "stopped by the launcher", "finished")))


@pytest.mark.parametrize(
    "args, value",
    [
        (["--task", "digits-mlp", "--steps", "2000"], 2000),
        (["--steps", "10", "--steps=20"], 20),
        (["--steps"], None),
        (["--stepsize", "3"], None),
        ([], None),
    ],
)
def test_flag_value(args, value):
    assert _flag_value(args, "--steps") == value


def test_report_counts_attackers_that_never_started_and_says_why_and_where(tmp_path):
    # Two attackers that died before announcing a peer ID: the report still says "the 2 attackers".
    peers = [
        PeerView("trainer-0", exit_code=2, last_error="error: --task: no such task"),
        PeerView("byzantine-0", attack="sign_flip", exit_code=2),
        PeerView("byzantine-1", attack="sign_flip", exit_code=2),
    ]
    reasons = {v.name: exit_reason(v, steps=None, swarm_reached_target=False) for v in peers}
    result = SwarmResult(
        reached_target=False, wall_s=3.0, time_to_target_s=None, peers=peers, best=None, target=0.95, reasons=reasons,
        startup={"bootstrap up": 1.5, "all on the DHT": None, "all see their peers": None, "first step": None},
        kept_workdir=tmp_path,
    )  # fmt: skip
    out = io.StringIO()
    print_report(result, Console(file=out, width=200))
    text = out.getvalue()
    assert "the 2 attackers (sign_flip)" in text
    assert "error: --task: no such task" in text
    assert "no trainer took a step (bootstrap up 1.5 s)" in text
    assert "target 0.95 NOT reached" in text
    assert f"kept in {tmp_path}" in text


def test_startup_line_gives_time_to_first_step_and_each_stage():
    result = SwarmResult(
        reached_target=True, wall_s=9.0, time_to_target_s=8.0, peers=[], best=0.95,
        startup={
            "bootstrap up": 2.0, "all on the DHT": 5.25, "all see their peers": 5.5, "first step": 6.0, "all training": 7.0
        },
    )  # fmt: skip
    assert startup_line(result) == (
        "time to first step 6.0 s (bootstrap up 2.0 s, all on the DHT 5.2 s, all see their peers 5.5 s, all training 7.0 s)"
    )


def test_startup_stages_count_trainers_and_take_the_last_one_to_get_there(tmp_path):
    from phalanx.tools.launcher.swarm import Swarm

    swarm = Swarm(3, ["--steps", "50"], workdir=tmp_path, live=False)
    assert swarm.steps == 50
    assert swarm._stage().startswith("starting the bootstrap peer…")
    swarm.bootstrap_s = 1.0
    assert swarm._stage() == "bootstrap up · importing torch for the trainers…"
    swarm.zygote._ready.set()  # the zygote has imported
    a, b, c = swarm.views
    a.process = b.process = c.process = object()  # spawned
    a.connected_s, b.connected_s = 2.0, 3.0
    a.ready_s = 3.5
    assert swarm._stage() == "bootstrap up · 3/3 started · 2/3 on the DHT · 1/3 see peers · 0/3 training"
    assert swarm.startup() == {
        "bootstrap up": 1.0, "all on the DHT": None, "all see their peers": None, "first step": None, "all training": None
    }  # fmt: skip
    c.connected_s, b.ready_s, c.ready_s = 4.0, 4.5, 4.25
    a.first_step_s, b.first_step_s = 5.0, 4.75
    c.exit_code = 1
    assert swarm._stage().endswith("· 2/3 training · 1 exited")
    assert swarm.startup() == {
        "bootstrap up": 1.0, "all on the DHT": 4.0, "all see their peers": 4.5, "first step": 4.75, "all training": None
    }  # fmt: skip
    c.first_step_s = 6.5  # (a trainer that stepped, then exited, stepped)
    assert swarm.startup()["all training"] == 6.5
    assert not swarm._starting()  # every trainer trains or has exited
