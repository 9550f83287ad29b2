"""Session-wide cleanup of what SIGKILLed peers leave in the temporary folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

TORCH_SHM_DIRS = "torch-shm-dir-*"


def _orphaned_torch_shm_dirs(before: set[Path]) -> list[Path]:
    """Folders of torch's shared-memory manager (hivemind shares tensors through files) that appeared
    during the session and whose manager is gone: it removes its folder itself once its clients exit,
    but tests SIGKILL peers' process groups, manager included."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    bound = {fields[7] for fields in map(str.split, lines) if len(fields) >= 8}  # live unix sockets' paths
    return [
        folder
        for folder in set(Path(tempfile.gettempdir()).glob(TORCH_SHM_DIRS)) - before
        if str(folder / "manager.sock") not in bound
    ]


@pytest.fixture(scope="session", autouse=True)
def remove_orphaned_torch_shm_dirs():
    before = set(Path(tempfile.gettempdir()).glob(TORCH_SHM_DIRS))
    yield
    for folder in _orphaned_torch_shm_dirs(before):
        for entry in folder.iterdir():
            entry.unlink(missing_ok=True)
        folder.rmdir()
