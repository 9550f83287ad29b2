"""The adversary suite: attacks by outsiders and round members on live peers over loopback.

Each test names a row of docs/threat-model.md. Attackers are what an outsider has: a plain hivemind
DHT node that stores what it likes, raw sockets, or a patched peer."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # live_swarm, the patched joiners
sys.path.insert(0, str(Path(__file__).parents[1] / "peer" / "health"))  # health_swarm: processes and HTTP reads
