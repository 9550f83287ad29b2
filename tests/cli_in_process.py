"""`phalanx <args>` run through its entry point (`phalanx.cli.main`) in the test process: a user mistake's
exit code and lines without the 5 CPU-seconds of a fresh interpreter's imports. What the CLI changes of
the process (PHALANX_* settings, its debug flag, logging handlers, import hooks) is put back after."""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import pytest


def run_cli(args: list[str], monkeypatch, capsys, env: dict[str, str] | None = None) -> SimpleNamespace:
    """returncode, stdout and stderr of `phalanx *args`, with the test's PHALANX_* settings gone and `env` set."""
    from phalanx import cli

    for name in [n for n in os.environ if n.upper().startswith("PHALANX_")]:
        monkeypatch.delenv(name)
    for name, value in {"COLUMNS": "200", **(env or {})}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(cli._state, "debug", False)
    root, hivemind_log = logging.getLogger(), logging.getLogger("hivemind")
    saved = (root.handlers[:], root.level, hivemind_log.handlers[:], hivemind_log.propagate, hivemind_log.level, sys.meta_path[:])
    capsys.readouterr()
    try:
        cli.main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        root.handlers[:], root.level, hivemind_log.handlers[:], hivemind_log.propagate, hivemind_log.level = saved[:5]
        sys.meta_path[:] = saved[5]
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


@pytest.fixture
def phalanx_cli(monkeypatch, capsys):
    """`phalanx_cli(args, env=None)`: `run_cli` with this test's monkeypatch and capsys."""
    return lambda args, env=None: run_cli(args, monkeypatch, capsys, env)
