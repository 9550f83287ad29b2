"""Container entry point: fill in what a container cannot know in advance, then run `phalanx ARGS`.

- PHALANX_BOOTSTRAP_URL (e.g. http://bootstrap:8080) and no PHALANX_INITIAL_PEERS: wait for that
  peer's /api/v1/status and join through the addresses it reports (its peer ID is only known
  once its identity exists).
- PHALANX_REPLICA_DIR (e.g. /data): each replica of a scaled service keeps its own identity and
  checkpoints in <dir>/<container hostname>/, so `--scale trainer=N` never shares a key.
Anything set explicitly (flags or PHALANX_* variables) wins. Joining a remote swarm needs
neither: pass --initial-peers as usual.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request


def bootstrap_addresses(url: str, wait_s: float) -> str:
    status_url = url.rstrip("/") + "/api/v1/status"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(status_url, timeout=5) as reply:
                addresses = json.load(reply)["addresses"]
            usable = [a for a in addresses if "/127.0.0.1/" not in a and "/p2p-circuit" not in a]
            if usable:
                return ",".join(usable)
            problem = "it reports no address reachable from here"
        except (OSError, ValueError, KeyError) as e:
            problem = str(e)
        if time.monotonic() > deadline:
            sys.exit(
                f"error: PHALANX_BOOTSTRAP_URL: no peer addresses from {status_url} after {wait_s:.0f} s ({problem})"
            )
        time.sleep(2)


def main(args: list[str]) -> None:
    env = os.environ
    replica_dir = env.get("PHALANX_REPLICA_DIR")
    if replica_dir:
        own = os.path.join(replica_dir, env.get("HOSTNAME") or socket.gethostname())
        os.makedirs(own, exist_ok=True)
        env.setdefault("PHALANX_IDENTITY_PATH", os.path.join(own, "identity.key"))
        if args[:1] == ["join"]:
            env.setdefault("PHALANX_CHECKPOINT_DIR", os.path.join(own, "checkpoints"))
    if env.get("PHALANX_BOOTSTRAP_URL") and not env.get("PHALANX_INITIAL_PEERS") and args[:1] != ["bootstrap"]:
        env["PHALANX_INITIAL_PEERS"] = bootstrap_addresses(
            env["PHALANX_BOOTSTRAP_URL"], float(env.get("PHALANX_BOOTSTRAP_WAIT_S", "120"))
        )
    os.execvp("phalanx", ["phalanx", *args])


if __name__ == "__main__":
    main(sys.argv[1:])
