"""Session-wide hooks: the network-namespace tests kept together, and cleanup of what SIGKILLed peers
leave in the temporary folder."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

TORCH_SHM_DIRS = "torch-shm-dir-*"
LAB = Path(__file__).parent / "faults"
# tests run in parallel worker processes (pytest -n, the README's command). The lab's swarms measure stalls
# and steps/s on separate hosts, so they are never two to a worker: the fault table's rows run one after
# another on one worker, the other lab tests on a second (each lab is its own set of namespaces), both sent
# first, while the other workers share the rest of the suite
LAB_GROUPS = {"test_fault_scenarios.py": "lab-table"}  # file → its group; the lab's other files: "lab-net"
FRESH_S = 60.0  # a shared-memory folder this young may be another worker's, its manager not yet listening


def pytest_collection_modifyitems(config, items):
    lab = [item for item in items if LAB in item.path.parents]
    for item in lab:
        item.add_marker(pytest.mark.xdist_group(LAB_GROUPS.get(item.path.name, "lab-net")))
    items[:] = lab + [item for item in items if LAB not in item.path.parents]


@pytest.fixture
def short_tmp():
    """A temporary folder with a short path, for peers given it as TMPDIR: torch's shared-memory manager
    puts a unix socket in it, and a socket's path may not exceed 108 bytes (pytest's tmp_path under a
    worker of `-n` is one folder deeper and was too long)."""
    folder = Path(tempfile.mkdtemp(prefix="px-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _orphaned_torch_shm_dirs(before: set[Path]) -> list[Path]:
    """Folders of torch's shared-memory manager (hivemind shares tensors through files) that appeared
    during the session and whose manager is gone: it removes its folder itself once its clients exit,
    but tests SIGKILL peers' process groups, manager included."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    bound = {fields[7] for fields in map(str.split, lines) if len(fields) >= 8}  # live unix sockets' paths
    return [
        folder
        for folder in set(Path(tempfile.gettempdir()).glob(TORCH_SHM_DIRS)) - before
        if str(folder / "manager.sock") not in bound and _age_s(folder) > FRESH_S
    ]


def _age_s(folder: Path) -> float:
    try:
        return time.time() - folder.stat().st_mtime
    except FileNotFoundError:
        return 0.0  # gone meanwhile: nothing to remove


@pytest.fixture(scope="session", autouse=True)
def remove_orphaned_torch_shm_dirs():
    before = set(Path(tempfile.gettempdir()).glob(TORCH_SHM_DIRS))
    yield
    for folder in _orphaned_torch_shm_dirs(before):
        for entry in folder.iterdir():
            entry.unlink(missing_ok=True)
        folder.rmdir()
