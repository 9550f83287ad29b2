"""The adversary suite: attacks by outsiders and round members on live peers over loopback.

Each test names a row of docs/threat-model.md. Attackers are what an outsider has: a plain hivemind
DHT node that stores what it likes, raw sockets, or a patched peer."""
