"""`phalanx --help` and flag mistakes must not wait for torch, hivemind & co. (seconds each):
the heavy modules load inside the commands that use them. `phalanx bench cli` measures the time."""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "hivemind", "scipy", "matplotlib", "aiohttp", "prometheus_client", "sklearn", "numpy")

PROBE = """
import json, sys
import phalanx.cli
try:
    phalanx.cli.main(json.loads(sys.argv[1]))
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy} if m in sys.modules)), file=sys.__stderr__)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["join", "--help"],
        ["bootstrap", "--help"],
        ["health", "--help"],
        ["monitor", "--help"],
        ["swarm", "--help"],
        ["bench", "--help"],
        ["join", "--stesp", "3"],
        ["join", "--steps", "zero"],
        ["swarm", "--peers", "6", "--byzantine", "2", "--aggregator", "centered_clip", "--verify"],  # no --tau
    ],
)
def test_help_and_flag_mistakes_import_nothing_heavy(argv):
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), json.dumps(argv)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stderr.strip().splitlines()[-1]) == [], done.stderr


def _python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: logging's configuration is process-wide."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_hivemind_logs_go_through_our_handler_when_it_is_imported_later():
    code = (
        "import logging; from peer.logs import configure_logging; configure_logging('text');"
        "from hivemind.utils.logging import get_logger; get_logger('hivemind.dht');"
        "h = logging.getLogger('hivemind'); print(len(h.handlers), h.propagate, h.level == logging.WARNING)"
    )
    done = _python(code)
    assert done.stdout.split() == ["0", "True", "True"], done.stderr


def test_debug_logs_ours_but_not_the_multiaddr_parsers_internals():
    code = (
        "import logging; from peer.logs import configure_logging; configure_logging('text', debug=True);"
        "print(logging.getLogger('phalanx.protocol').isEnabledFor(logging.DEBUG),"
        " logging.getLogger('multiaddr.codecs.cid').isEnabledFor(logging.DEBUG))"
    )
    done = _python(code)
    assert done.stdout.split() == ["True", "False"], done.stderr


@pytest.mark.parametrize("command", ["join", "bootstrap", "health", "monitor"])
def test_help_at_80_columns_shows_every_flag_whole_with_its_default_and_variable(command):
    from phalanx.peer.config import MonitorSettings, NetworkSettings, PeerConfig

    done = subprocess.run(
        [sys.executable, "-m", "phalanx", command, "--help"], capture_output=True, text=True, timeout=120,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # help text wraps; flags and names must not be cut
    model = {"join": PeerConfig, "monitor": MonitorSettings}.get(command, NetworkSettings)
    shown = [name for name in model.model_fields if f"--{name.replace('_', '-')}" in text]
    assert len(shown) >= 5
    for name in shown:
        assert f"[env: PHALANX_{name.upper()}]" in text, name
    lines = done.stdout.splitlines()
    assert not [line for line in lines if len(line) > 80], "lines wider than 80 columns"
    for name in shown:  # each flag starts a line, whole (rich's table cut long names with "…")
        flag = f"--{name.replace('_', '-')}"
        assert any(line.strip().split(" ")[0] == flag for line in lines), flag
    if command == "join":
        assert "[default: 25] [env: PHALANX_EVAL_EVERY]" in text
        assert "Built-in task (digits-mlp, mnist-cnn, cifar10-resnet18, tiny-gpt)" in text
