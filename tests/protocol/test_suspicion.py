"""Suspicion of a peer that does not answer: a peer suspected again as soon as it is let back is suspected
twice as long each time (up to 16 times), and one that stays clear as long as it was suspected starts over."""

import types

import pytest

from phalanx.protocol import membership as module
from phalanx.protocol.membership import MAX_SUSPICION_DOUBLINGS, Membership

PEER = "QmPeer"


@pytest.fixture
def clock(monkeypatch):
    now = types.SimpleNamespace(t=1000.0)
    monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=lambda: now.t))
    return now


def _suspected_for(m: Membership, clock) -> float:
    """How long `PEER` stays suspected from now (by stepping the clock)."""
    start = clock.t
    while m.is_suspect(PEER):
        clock.t += 0.5
    return clock.t - start


def test_a_peer_suspected_again_as_soon_as_it_is_let_back_waits_twice_as_long_up_to_a_bound(clock):
    m = Membership(None, "k.peers", "QmMe")
    lengths = []
    for _ in range(MAX_SUSPICION_DOUBLINGS + 3):
        m.suspect(PEER, for_s=8)
        lengths.append(_suspected_for(m, clock))
    assert lengths == [8.5, 16.5, 32.5, 64.5, 128.5, 128.5, 128.5]  # (the clock steps 0.5 s past the end)


def test_a_peer_clear_as_long_as_its_last_suspicion_starts_over(clock):
    m = Membership(None, "k.peers", "QmMe")
    m.suspect(PEER, for_s=8)
    _suspected_for(m, clock)
    m.suspect(PEER, for_s=8)  # at once: doubled
    assert _suspected_for(m, clock) == 16.5
    clock.t += 17  # clear for longer than it was last suspected
    m.suspect(PEER, for_s=8)
    assert _suspected_for(m, clock) == 8.5


def test_an_answer_clears_the_suspicion_and_its_history(clock):
    m = Membership(None, "k.peers", "QmMe")
    for _ in range(3):
        m.suspect(PEER, for_s=8)
        _suspected_for(m, clock)
    m.clear_suspicion(PEER)
    m.suspect(PEER, for_s=8)
    assert _suspected_for(m, clock) == 8.5


def test_a_suspicion_under_way_is_extended_not_doubled(clock):
    m = Membership(None, "k.peers", "QmMe")
    m.suspect(PEER, for_s=8)
    clock.t += 4
    m.suspect(PEER, for_s=8)
    assert _suspected_for(m, clock) == 8.5


def test_suspected_since_counts_only_evidence_from_then_on(clock):
    """A round's member drops the next group it joined early only on evidence newer than its join: a peer
    it suspected before, which the leader put in that group on its own join since, is alive."""
    m = Membership(None, "k.peers", "QmMe")
    m.suspect(PEER, for_s=8)
    joined_early = clock.t + 1
    clock.t = joined_early
    assert m.is_suspect(PEER) and not m.suspected_since(PEER, joined_early)
    clock.t += 1
    m.suspect(PEER, for_s=8)  # found dead again during the round
    assert m.suspected_since(PEER, joined_early)
    m.clear_suspicion(PEER)
    assert not m.suspected_since(PEER, joined_early) and not m.suspected_since(PEER, float("-inf"))
