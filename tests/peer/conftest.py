import hivemind
import pytest

from tests.procs import LOOPBACK


@pytest.fixture
def bootstrap():
    """A DHT on loopback that peers join through: its multiaddrs."""
    dht = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    yield [str(m) for m in dht.get_visible_maddrs()]
    dht.shutdown()
