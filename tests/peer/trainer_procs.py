"""Helpers for the peer tests that start `phalanx` joins and users' scripts (the processes themselves:
tests.procs)."""

from __future__ import annotations

from pathlib import Path

# test_diloco.py and test_optimizer.py take these from here
from tests.procs import LOOPBACK, start_script, wait_scripts  # noqa: F401
from tests.procs import spawn_events as spawn  # noqa: F401


def join_args(initial_peers: list[str], tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        "join", "--initial-peers", *initial_peers, "--host-maddrs", LOOPBACK,
        "--identity-path", str(tmp / f"{name}.id"), "--events", *extra,
    ]  # fmt: skip


def load_example(name: str):
    """examples/<name>.py as a module (the tests' user scripts reuse its model and data)."""
    import importlib.util

    path = Path(__file__).parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
