"""A peer process for fault tests: joins one group, announces it, then stalls until killed.

Run as `python stalling_peer.py <initial peer>...`; prints `READY <peer id> <unix socket>...` once announced,
joins matchmaking when a line with the number of other peers arrives on stdin and it sees them
(so that it joins together with the test's peers, not alone or seconds before them), and prints `IN_GROUP <round id hex> <members,...>` once the
leader put it in a group.
"""

import asyncio
import sys

import torch

from phalanx.protocol.config import MatchmakingConfig, RoundConfig
from tests.protocol.swarm_fixture import open_peer


async def main(initial_peers: list[str]) -> None:
    config = RoundConfig(matchmaking=MatchmakingConfig(matchmaking_timeout_s=30.0, join_timeout_s=120.0))
    peer = await open_peer(initial_peers, config)
    peer.engine.set_state(b"v0", 0)
    p2p = peer.transport.p2p  # a SIGKILL leaves the daemon's and our client's unix sockets: the test removes them
    sockets = [str(m).removeprefix("/unix") for m in (p2p._daemon_listen_maddr, p2p._client_listen_maddr)]
    print("READY", peer.peer_id, *sockets, flush=True)
    others = int(await asyncio.to_thread(sys.stdin.readline))  # how many other peers to see before joining
    while len(set(peer.membership.peers()) - {peer.peer_id}) < others:
        await peer.membership.refresh()  # a peer that sees nobody else leads a group of one
    reply = await peer.engine.matchmaker.join(version=b"v0", step=0)
    print("IN_GROUP", reply.group.round_id.hex(), ",".join(reply.group.members), flush=True)
    await asyncio.sleep(3600)  # never sends its parts: the others must drop it


if __name__ == "__main__":
    torch.set_num_threads(1)
    asyncio.run(main(sys.argv[1:]))
