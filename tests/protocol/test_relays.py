"""Relayed peers: the circuits a record may name, the p2pd flags of homes and of relays, the bytes a
relay carries, and how health calls such a peer. The lab scenario N2 (tests/faults/test_nat_scenarios.py)
runs them together: four homes train as one swarm through the bootstrap."""

import pytest
from pydantic import ValidationError

from phalanx.peer.config import NetworkSettings
from phalanx.peer.health.service import reachability
from phalanx.peer.node import RELAY_TIME_LIMIT, relay_candidates, relay_flags
from phalanx.protocol.membership import MAX_RELAYS, PeerRecord
from phalanx.protocol.transport_wire import RelayedStats, TransportStats

RELAY = "/ip4/10.77.0.1/tcp/31337/p2p/12D3KooWKKZryKu8qZU7cPTqM1bwtUbaDLvtH6ZQLfkQNE8c9gQ9"
HOME = "12D3KooWS8x7BP4XMZPCduVsXJcDMkxnfNxXiw3GaFwbd9MkgwXx"
OTHER = "12D3KooWGaAGP7zcs33D7ApBJb5sAq5Ba91tj8L8D2gF3MEBdAZ2"


def test_a_record_names_circuits_to_its_own_peer_only():
    record = PeerRecord(state="online", step=0, reachable=False, relays=[f"{RELAY}/p2p-circuit/p2p/{HOME}"])
    assert record.circuits(HOME) == [f"{RELAY}/p2p-circuit/p2p/{HOME}"]
    assert record.circuits(OTHER) == []  # a record cannot send others' calls for another peer anywhere


@pytest.mark.parametrize(
    "relays",
    [
        [RELAY],  # no circuit
        ["/not/a/multiaddr"],
        [f"{RELAY}/p2p-circuit/p2p/{HOME}" + "/p2p-circuit/p2p/" + OTHER],  # two hops
        [f"{RELAY}/p2p-circuit/p2p/{HOME}"] * (MAX_RELAYS + 1),
        ["/ip4/10.0.0.1/tcp/1/p2p-circuit/p2p/" + HOME + "x" * 400],
    ],
)
def test_malformed_relay_addresses_are_refused(relays):
    with pytest.raises(ValidationError):
        PeerRecord(state="online", step=0, reachable=False, relays=relays)


def test_a_home_reserves_slots_on_its_initial_peers_at_once():
    settings = NetworkSettings(initial_peers=[RELAY])
    assert relay_candidates(settings) == [RELAY]
    create, flags = relay_flags(settings, [RELAY])
    assert create == dict(force_reachability="private", use_auto_relay=True, trusted_relays=[RELAY])
    assert flags == {"relayDiscovery": False}  # libp2p's discovery would wait minutes for candidates
    assert relay_candidates(NetworkSettings(initial_peers=[RELAY], client_mode=True)) == []
    assert relay_candidates(NetworkSettings(initial_peers=[RELAY], use_relay=False)) == []
    assert relay_flags(settings) == ({}, {})  # a trainer others can dial changes nothing


def test_a_swarms_entry_point_relays_within_its_budget():
    create, flags = relay_flags(NetworkSettings(relay_budget_gb=2.5))
    assert create == dict(force_reachability="public")  # AutoNAT never dials private addresses
    assert flags["relayDataLimit"] == 2_500_000_000 and flags["relayTimeLimit"] == RELAY_TIME_LIMIT
    assert relay_flags(NetworkSettings(relay_budget_gb=0)) == ({}, {"relayService": False})


def test_relayed_bytes_count_in_the_totals_and_as_relayed():
    totals = TransportStats(bytes_sent=100)
    relayed = RelayedStats(totals)
    relayed.bytes_sent += 10
    relayed.bytes_received += 5
    relayed.bytes_sent += 3
    assert (totals.bytes_sent, totals.bytes_received, totals.relayed_bytes) == (113, 5, 18)
    assert (relayed.bytes_sent, relayed.bytes_received) == (13, 5)


def test_health_calls_a_peer_reached_only_through_a_relay_relay():
    lan = ["/ip4/10.78.1.2/tcp/31337"]
    assert reachability(lan, False) == "direct"
    assert reachability(lan, False, relayed=True) == "relay"
    assert reachability(lan, False, relayed=True, punched=True) == "punched"
    assert reachability(lan, True) == "client"  # unreachable with no relay left


class _FakeP2P:
    def __init__(self, connected: dict[str, list[str]]) -> None:
        self.connected, self.dialed = connected, []
        self._client = self

    async def list_peers(self):
        from types import SimpleNamespace

        from hivemind.p2p import PeerID
        from multiaddr import Multiaddr

        return [SimpleNamespace(peer_id=PeerID.from_base58(p), addrs=[Multiaddr(a) for a in addrs]) for p, addrs in self.connected.items()]

    async def connect(self, peer, maddrs):
        self.dialed.append((peer.to_base58(), [str(m) for m in maddrs]))


def test_the_keeper_publishes_live_circuits_dials_relayed_peers_and_counts_punched_holes():
    import asyncio
    from types import SimpleNamespace

    from phalanx.protocol.membership import Membership
    from phalanx.protocol.relays import RelayKeeper

    third = "12D3KooWFErEk3D6zZ5Ge5tM9P2uAdQKdsoywUVLikTC2AdqC5JD"
    fourth = "12D3KooWS9MPxQURp1Y7WhiEmjEa1VyubPrby5JHL8u5rXQQbz5G"
    relay_id = RELAY.rsplit("/p2p/", 1)[1]
    membership = Membership(None, "k.peers", HOME, reachable=False)
    membership._view = {
        peer: (PeerRecord(state="online", step=0, reachable=False, relays=[f"{RELAY}/p2p-circuit/p2p/{peer}"]), float("inf"))
        for peer in (OTHER, third, fourth)
    }
    # connected: the relay, OTHER directly (a punched hole); `third` and `fourth` not yet
    p2p = _FakeP2P({relay_id: [RELAY.rsplit("/p2p/", 1)[0]], OTHER: ["/ip4/11.77.0.5/tcp/4102"]})
    transport = SimpleNamespace(p2p=p2p, circuits={})
    keeper = RelayKeeper(transport, membership, [RELAY])
    asyncio.run(keeper.tick())
    assert membership.relays == [f"{RELAY}/p2p-circuit/p2p/{HOME}"]
    # every relayed peer not connected yet is dialed, whichever id is smaller: p2pd routes to it only so
    assert sorted(p2p.dialed) == sorted((p, [f"{RELAY}/p2p-circuit/p2p/{p}"]) for p in (third, fourth))
    assert set(transport.circuits) == {OTHER, third, fourth}
    assert (keeper.stats.circuits, keeper.stats.relayed_peers, keeper.stats.punched) == (1, 3, 1)
    p2p.connected.pop(relay_id)  # the relay is gone: no circuit is published any more
    asyncio.run(keeper.tick())
    assert membership.relays == [] and keeper.stats.circuits == 0
