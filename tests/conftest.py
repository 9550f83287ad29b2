"""Session-wide hooks: the network-namespace tests kept together, the long tier (`--long`), and cleanup of
what SIGKILLed peers leave in the temporary folder."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.cli_in_process import phalanx_cli  # noqa: F401 (a fixture for every test)

TORCH_SHM_DIRS = "torch-shm-dir-*"
ROOT = Path(__file__).parent.parent
LAB = ROOT / "tests" / "faults"
# with `pytest -n N` (parallel worker processes): the lab's swarms measure stalls and steps/s on separate hosts,
# so no worker runs two at once: the fault table's rows run one after another on one worker, the other lab
# tests on a second (each lab is its own set of namespaces), both sent first, while the others share the rest
LAB_GROUPS = {"test_fault_scenarios.py": "lab-table"}  # file → its group; the lab's other files: "lab-net"
LONG_SKIP = "LONG, runs with --long"  # how a long test's skip reason starts (counted at the end)
FRESH_S = 60.0  # a shared-memory folder this young may be another worker's, its manager not yet listening


def lab_group(path: Path) -> str | None:
    return LAB_GROUPS.get(path.name, "lab-net") if LAB in path.parents else None


def pytest_addoption(parser):
    parser.addoption(
        "--long", action="store_true",
        help="also run the tests marked long (whole lab scenarios, big swarms); without it each skips, naming its small variant",
    )  # fmt: skip


def pytest_configure(config):
    config.addinivalue_line("markers", "long(variant): a long lab scenario or big swarm; `variant` names the test CI runs instead")


def pytest_collection_modifyitems(config, items):
    """The lab's tests first, so that its groups start at once on workers of their own; without `--long`,
    long tests skip with the name of the small variant that runs in their place."""
    items[:] = sorted(items, key=lambda item: lab_group(item.path) is None)  # (a stable sort)
    if config.getoption("--long"):
        return
    for item in items:
        mark = item.get_closest_marker("long")
        if mark is not None:
            variant = mark.args[0] if mark.args else mark.kwargs["variant"]
            item.add_marker(pytest.mark.skip(reason=f"{LONG_SKIP}; in its place: {variant}"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = terminalreporter.stats.get("skipped", [])
    long = sum(1 for report in skipped if LONG_SKIP in str(report.longrepr))
    if long:
        terminalreporter.write_line(
            f"{long} long tests skipped: `pytest --long` runs them too (docs/getting-started.md, the tests)", yellow=True, bold=True
        )


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler with each lab group one unit of work (its tests in turn on one worker) and
    every other test a unit of its own. (Not xdist's `xdist_group` marks: xdist 3.8 groups by renaming
    test IDs, which pytest 9 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class LabGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lab_group(ROOT / nodeid.split("::", 1)[0]) or nodeid

    return LabGroups(config, log)


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


@pytest.fixture(scope="session", autouse=True)
def no_router_search_from_loopback():
    """Hosts the tests start in-process (hivemind's P2P, their DHTs' too: forked after this) listen on
    loopback; p2pd's router search for a port mapping would still multicast on the machine's LAN and write
    to its gateway. As `phalanx` peers do (`phalanx.peer.ports.maps_ports`), a loopback host does not
    search; a caller that passes nat_port_map itself keeps its choice."""
    from hivemind.p2p import P2P

    from phalanx.peer.ports import maps_ports

    create = P2P.create.__func__

    async def create_without_search(cls, *args, **kwargs):
        listen = kwargs.get("host_maddrs", ("/ip4/127.0.0.1/tcp/0",)) or ()  # (hivemind's default)
        kwargs.setdefault("nat_port_map", maps_ports([str(maddr) for maddr in listen]))
        return await create(cls, *args, **kwargs)

    P2P.create = classmethod(create_without_search)
    yield
    P2P.create = classmethod(create)
