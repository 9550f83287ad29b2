import sys
from pathlib import Path

import hivemind
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # trainer_procs

from trainer_procs import LOOPBACK  # noqa: E402


@pytest.fixture
def bootstrap():
    """A DHT on loopback that peers join through: its multiaddrs."""
    dht = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    yield [str(m) for m in dht.get_visible_maddrs()]
    dht.shutdown()
