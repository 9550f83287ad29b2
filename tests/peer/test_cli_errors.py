"""Every user mistake in docs/errors.md, run through the real `phalanx` command: the exit code, exactly
one line on stderr (the documented one, naming the flag and the fix) and no traceback. The table in
the doc is the test's data, so the two cannot drift apart.

Rows that need a peer, a held port or a dead address run `python -m phalanx` in a process of its own;
the others call the command's entry point (`phalanx.cli.main`) in this process, with the environment
and logging it changes put back after each."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.cli_in_process import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
FILES = {  # what the first column of the table says each file holds
    "broken.toml": "steps = \n",
    "typo.toml": "stesp = 3\n",
    "value.toml": "batch-size = 0\n",
    "other.toml": 'task = "digits-mlp"\n',
    "a_file": "not a folder\n",
}
DEAD_ID = "QmdkQRh9vunbfpqzuFuwH2F1uKgPSeejQS6eM23ArdWdf7"


def table_rows() -> list[dict[str, str]]:
    text = DOC.read_text()
    body = text[text.index("<!-- errors:begin -->") : text.index("<!-- errors:end -->")]
    rows = []
    for line in body.splitlines()[3:]:  # after the marker, header and rule
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"docs/errors.md row has {len(cells)} cells: {line}"
        rows.append({"input": cells[0], "command": cells[1].strip("`"), "exit": cells[2], "message": cells[3]})
    return rows


ROWS = table_rows()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Values of the placeholders that need no running peer: a held port, a dead address, a folder."""
    tmp = tmp_path_factory.mktemp("cli-errors")
    for name, content in FILES.items():
        (tmp / name).write_text(content)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    values = {"tmp": str(tmp), "busy": str(busy.getsockname()[1]), "dead": f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{DEAD_ID}"}
    yield values
    busy.close()


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    """A running `phalanx bootstrap` with an identity file: its address, port and identity."""
    tmp = tmp_path_factory.mktemp("cli-errors-boot")
    identity = tmp / "boot.id"
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "bootstrap", "--identity-path", str(identity), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, env=_env({}),
    )  # fmt: skip
    try:
        line = next(line for line in proc.stdout if line.startswith("--initial-peers"))
        boot = line.split()[1].split(",")[0]
        yield {"boot": boot, "boot_port": boot.split("/")[4], "boot_id": str(identity)}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        while _group_alive(proc.pid):  # its DHT process and p2pd leave with it
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PHALANX_")}
    return {**env, "COLUMNS": "200", **extra}


def _fill(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], text)


def _pattern(message: str) -> re.Pattern:
    return re.compile("".join(".*" if part == "…" else re.escape(part) for part in re.split("(…)", message)) + r"\Z")


NEEDS_A_PROCESS = ("{boot", "{dead}", "{busy}")  # rows that start a node, hold a port or wait on a dead peer


def run_row(row: dict[str, str], values: dict[str, str], monkeypatch, capsys) -> SimpleNamespace:
    words = shlex.split(_fill(row["command"], values))
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "phalanx", row
    if any(p in row["command"] for p in NEEDS_A_PROCESS):
        done = subprocess.run(
            [sys.executable, "-m", "phalanx", *words[1:]], capture_output=True, text=True, timeout=240,
            env=_env(env), start_new_session=True,
        )  # fmt: skip
        return SimpleNamespace(returncode=done.returncode, stderr=done.stderr)
    return run_cli(words[1:], monkeypatch, capsys, env)


@pytest.mark.parametrize("row", ROWS, ids=[row["input"] for row in ROWS])
def test_each_mistake_gets_its_documented_line(row, places, request, monkeypatch, capsys):
    values = dict(places)
    if "{boot" in row["command"]:
        values |= request.getfixturevalue("bootstrap")
    done = run_row(row, values, monkeypatch, capsys)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    expected = _fill(row["message"], values)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == int(row["exit"]), done.stderr
    if expected.startswith("warning:"):  # the warning comes first; the command then goes on
        assert lines and _pattern(expected).match(lines[0]), done.stderr
    else:
        assert len(lines) == 1, done.stderr
        assert _pattern(expected).match(lines[0]), f"\n got: {lines[0]}\nwant: {expected}"
    assert re.search(r"--[a-z]|PHALANX_", lines[0]), "the line must name the flag, variable or file"


def test_debug_shows_the_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "--debug", "join", "--aggregator", "nope"],
        capture_output=True, text=True, timeout=120, env=_env({}),
    )  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "unknown aggregator 'nope'" in done.stderr


def test_table_covers_each_kind_of_input():
    inputs = " ".join(row["command"] for row in ROWS)
    for needle in ("--config", "PHALANX_", "--task", "--data-dir", "--identity-path", "--checkpoint-dir", "--initial-peers", "--port", "--direct-port", "{busy}", "{boot_port}"):
        assert needle in inputs, needle


def test_builtin_task_names_match_the_registry():
    from phalanx.peer.config import BUILTIN_TASKS
    from phalanx.tasks import TASKS

    assert tuple(TASKS) == BUILTIN_TASKS


def test_a_lone_join_says_it_starts_a_swarm_and_ctrl_c_says_where_the_checkpoint_went(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "join", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(ckpt),
         "--checkpoint-every", "1", "--torch-threads", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=_env({}),
    )  # fmt: skip
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "checkpoint" in line or "step " in line and " loss " in line:
                break
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        while _group_alive(proc.pid):
            time.sleep(0.05)
    text = "".join(seen) + rest
    assert seen[0].startswith("notice: no --initial-peers: this peer starts a new swarm of its own"), text
    assert "others join this new swarm with: --initial-peers /ip4/127.0.0.1/tcp/" in text
    assert re.search(r"checkpoint saved: \S+ \(step \d+\); continue with --resume", text), text
    assert "Traceback" not in text
