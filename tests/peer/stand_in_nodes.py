"""Stand-ins for the swarm that `phalanx.Optimizer(..., node=...)` trains over, for what needs no network:
a node where no round ever forms (`alone_node`), and one whose every round is a round of one that
completes at once (`solo_node`): the aggregate of a group of one is its own vector."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

from phalanx.peer.node import NodeSnapshot
from phalanx.protocol.engine import Averaged
from phalanx.protocol.matchmaking import GroupSpec
from phalanx.protocol.round_spec import AllReduceResult


def alone_node(peer_id: str = "12D3KooWalone") -> SimpleNamespace:
    """No round ever forms: no other peer, no network."""

    async def never(*args, **kwargs):
        await asyncio.Event().wait()

    return _node(peer_id, never)


def solo_node(peer_id: str = "12D3KooWoneMember") -> SimpleNamespace:  # (base58: no l, I, O or 0)
    """Every round forms at once with this peer alone and hands its own vector back."""
    node = None

    async def round_of_one(request):
        engine = node.engine
        engine.rounds += 1
        group = GroupSpec(
            round_id=engine.rounds.to_bytes(16, "big"), members=[peer_id], step=engine.step, version=engine.version,
            donations=[],
        )  # fmt: skip
        vector = request.vector.detach().to("cpu", copy=True).float()
        result = AllReduceResult(vector, (), (), 1, 0, 0, 0.0)
        return Averaged(group, result)

    node = _node(peer_id, round_of_one)
    return node


def _node(peer_id: str, run_round) -> SimpleNamespace:
    async def nothing(*args, **kwargs):
        return None

    state = SimpleNamespace(keep_serving=lambda key: None, publish=nothing)
    engine = SimpleNamespace(step=0, version=b"", rounds=0, in_group=False, run_round=run_round, state=state)

    def set_state(version, step, **_):
        engine.version, engine.step = version, step

    async def completed(averaged, snapshot_fn):
        set_state(hashlib.sha256(engine.version + averaged.group.round_id).digest(), engine.step + 1)

    engine.set_state, engine.completed = set_state, completed
    membership = SimpleNamespace(peers=lambda: {peer_id: SimpleNamespace(step=engine.step)}, banned=set(), refresh=nothing)
    return SimpleNamespace(
        peer_id=peer_id, engine=engine, membership=membership, dht=SimpleNamespace(is_alive=lambda: True),
        snapshot=lambda: NodeSnapshot(peer_id, step=engine.step),
    )  # fmt: skip
