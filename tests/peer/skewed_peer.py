"""`python skewed_peer.py OFFSET_S <phalanx args…>`: a `phalanx` process whose DHT answers pings with
its clock OFFSET_S seconds off (hivemind's DHT process is forked, so it inherits the patch)."""

import sys
import time

import hivemind.dht.protocol

offset_s = float(sys.argv[1])
hivemind.dht.protocol.get_dht_time = lambda: time.time() + offset_s

from phalanx.cli import main  # noqa: E402

main(sys.argv[2:])
