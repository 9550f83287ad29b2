"""User mistakes around the health server get one line that names the flag and the fix."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_busy_http_port_is_a_one_line_config_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "phalanx", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--http-port", str(port)],
            capture_output=True, text=True, timeout=240, start_new_session=True,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --http-port: cannot listen on 127.0.0.1:{port} (")
    assert last.endswith("choose another port, or 0 to turn HTTP off")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["monitor", "join", "bootstrap"])
def test_out_of_range_http_port_is_refused_before_starting(command):
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", command, "--http-port", "70000"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --http-port: Input should be less than or equal to 65535 (got 70000)"
