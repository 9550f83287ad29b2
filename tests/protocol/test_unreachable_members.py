"""Members nobody can dial (behind home routers): they never lead, reduce no part, and still contribute
to every part and get every aggregate, over the calls they make themselves."""

import asyncio
import time

import pytest
import torch

from phalanx.protocol.allreduce import AllReduceService
from phalanx.protocol.config import RoundConfig
from phalanx.protocol.engine import Averaged, RoundRequest
from phalanx.protocol.membership import DIALABLE_MEMORY_S, Membership, PeerRecord
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
module_time = time.monotonic  # what Membership reads its clock with


def _view(me: str, reachable: dict[str, bool], *, me_reachable: bool) -> Membership:
    m = Membership(None, "k.peers", me, reachable=me_reachable)
    m._view = {p: (PeerRecord(state="online", step=0, reachable=r), float("inf")) for p, r in reachable.items()}
    return m


def test_only_peers_others_can_dial_lead_unless_none_can_be():
    peers = {"QmA": False, "QmB": True, "QmC": False, "QmD": True}
    for me, dialable in peers.items():
        assert _view(me, peers, me_reachable=dialable).leader() == "QmB"
    homes = {"QmA": False, "QmC": False}
    assert {_view(me, homes, me_reachable=False).leader() for me in homes} == {"QmA"}  # all agree: relays may help


@pytest.mark.parametrize("homes", [1, 2])
def test_members_nobody_can_dial_send_their_parts_and_get_the_mean(homes, monkeypatch):
    n, numel = 4, 300_000  # bulk parts: the direct path, where one exists
    reachable = [True] * (n - homes) + [False] * homes
    served: dict[str, int] = {}
    real_sink = AllReduceService._part_sink

    async def counting_sink(self, peer, header, payload_len):
        served[self.transport.peer_id] = served.get(self.transport.peer_id, 0) + 1
        return await real_sink(self, peer, header, payload_len)

    monkeypatch.setattr(AllReduceService, "_part_sink", counting_sink)

    async def main():
        async with open_swarm(n, RoundConfig(), reachable=reachable) as peers:
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(n)]
            for _ in range(2):
                outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)])
                mean = torch.stack(xs).mean(0)
                for peer, outcome in zip(peers, outcomes):
                    assert isinstance(outcome, Averaged), outcome
                    group = outcome.group
                    assert group.reducers == n - homes and set(group.members[n - homes :]) == {p.peer_id for p in peers[n - homes :]}
                    assert outcome.result.missing_parts == () and outcome.result.dropped_senders == ()
                    assert (outcome.result.vector - mean).abs().max().item() < 1e-6
                    await peer.engine.completed(outcome, dict)
            assert not any(served.get(p.peer_id) for p in peers[n - homes :]), "a part was sent to a member nobody can dial"
            assert all(served.get(p.peer_id) for p in peers[: n - homes])

    asyncio.run(main())


def test_a_peer_nobody_can_dial_never_leads_itself_while_a_dialable_peer_is_in_view():
    peers = {"QmA": False, "QmB": True, "QmC": False}
    home = _view("QmA", peers, me_reachable=False)
    home.suspect("QmB", for_s=60)  # its joins to the only dialable peer failed a moment ago
    assert home.leader() == "QmB"  # it waits for it rather than lead a group nobody can join


def test_a_dialable_peer_missing_from_one_read_is_still_waited_for():
    home = _view("QmA", {"QmA": False, "QmB": True, "QmC": False}, me_reachable=False)
    home._dialable_seen["QmB"] = module_time()  # read a moment ago ...
    home._view.pop("QmB")  # ... but not in this read
    assert home.leader() == "QmB"
    home._dialable_seen["QmB"] = module_time() - DIALABLE_MEMORY_S - 1  # long gone: the homes pick one of theirs
    assert home.leader() == "QmA"
