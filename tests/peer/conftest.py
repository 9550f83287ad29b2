import sys

import hivemind
import pytest

from tests.peer import trainer_procs
from tests.procs import LOOPBACK

# test_diloco.py and test_optimizer.py still import it by its bare name; the next edit of each can
# import tests.peer.trainer_procs instead, and this line go
sys.modules.setdefault("trainer_procs", trainer_procs)


@pytest.fixture
def bootstrap():
    """A DHT on loopback that peers join through: its multiaddrs."""
    dht = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    yield [str(m) for m in dht.get_visible_maddrs()]
    dht.shutdown()
