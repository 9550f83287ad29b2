"""How a leader closes groups under a sync policy: K counts joiners that contribute, and a lockstep
swarm forms one group per step. Driven through the leader's own join handling, no network."""

import asyncio

import pytest
from hivemind.utils import get_dht_time

from phalanx.protocol import matchmaking
from phalanx.protocol.config import MatchmakingConfig
from phalanx.protocol.link_quality import LinkQuality
from phalanx.protocol.matchmaking import MIXING_LAG, SLOW_WAIT_S, JoinRequest, Matchmaker, _Pending
from phalanx.protocol.membership import Membership, PeerRecord
from phalanx.protocol.sync_policy import parse_sync_policy

PEERS = [f"12D3KooW{c}" + "x" * 45 for c in "ABCDE"]  # base58, in leading order
RUN = b"r" * 32


class _Transport:
    peer_id = PEERS[0]  # the lowest ID: the leader

    def register(self, *args, **kwargs) -> None:
        pass


def _matchmaker(peers: list[str], policy: str, *, lockstep: bool = True, group_size=None) -> Matchmaker:
    membership = Membership(None, "k.peers", PEERS[0])
    far = get_dht_time() + 3600
    membership._view = {p: (PeerRecord(state="online", step=0), far) for p in peers}
    config = MatchmakingConfig(
        matchmaking_timeout_s=3600.0, join_timeout_s=7200.0, lockstep=lockstep, min_group_size=2, group_size=group_size
    )
    membership.link = LinkQuality(PEERS[0], membership.announce_soon, membership.peers)  # as the engine wires it
    return Matchmaker(_Transport(), membership, config, RUN, membership.link, sync_policy=parse_sync_policy(policy))


def _flag_slow(matchmaker: Matchmaker, peer: str) -> None:
    """Most of the others name `peer` slow in their membership records (the swarm's word, not the leader's)."""
    view = matchmaker.membership._view
    others = [p for p in view if p != peer]
    for other in others[: len(others) // 2 + 1]:
        record, expires = view[other]
        view[other] = (record.model_copy(update={"slow": [peer]}), expires)
        if other == matchmaker.peer_id:  # its own marks count as they are now
            matchmaker.link.note_slow([peer])


async def _join(matchmaker: Matchmaker, peer: str, step: int, version: bytes = b"", together=False) -> asyncio.Task:
    request = JoinRequest(run=RUN, version=version or bytes([step % 256]) * 32, step=step, together=together)
    task = asyncio.create_task(matchmaker._submit(peer, request))
    await asyncio.sleep(0.01)  # the leader takes the join in
    return task


def test_k_counts_only_joiners_in_sync_and_a_behind_one_resyncs_from_the_group():
    """k:3 of 4: a peer left out of the last round joins at the old step first. It must not count as one
    of the three, or the group closes with two contributors and the third falls behind in turn."""

    async def main():
        matchmaker = _matchmaker(PEERS[:4], "k:3")
        late = await _join(matchmaker, PEERS[3], step=4)
        first = [await _join(matchmaker, p, step=5) for p in PEERS[:2]]
        assert not any(t.done() for t in [late, *first])  # two of K = 3 in sync: still forming
        third = await _join(matchmaker, PEERS[2], step=5)
        replies = [await t for t in [*first, third]]
        group = replies[0].group
        assert {r.kind for r in replies} == {"group"} and sorted(group.members) == sorted(PEERS[:3])
        assert group.step == 5 and group.k == 3
        resync = await late
        assert resync.kind == "resync" and resync.donor in group.members
        await matchmaker.aclose()

    asyncio.run(main())


def test_a_joiner_at_the_step_with_another_version_counts_towards_k_and_resyncs():
    """After a partial round members can hold different versions of one step. The third joiner at that
    step closes the group (K = 3) instead of leaving it to wait for its deadline; it then resyncs."""

    async def main():
        matchmaker = _matchmaker(PEERS[:4], "k:3")
        same = [await _join(matchmaker, p, step=9) for p in PEERS[:2]]
        other = await _join(matchmaker, PEERS[2], step=9, version=b"o" * 32)
        replies = [await asyncio.wait_for(t, 5) for t in [*same, other]]
        assert [r.kind for r in replies] == ["group", "group", "resync"]
        assert sorted(replies[0].group.members) == sorted(PEERS[:2])
        await matchmaker.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("lockstep, sizes", [(True, [4]), (False, [3])])
def test_joiners_past_k_share_one_lockstep_group(lockstep, sizes):
    """Four in sync when K = 3 is reached (they joined together): in lockstep they form one group — two
    groups at one step would average different gradients and start two models. Asynchronous modes keep
    groups of K and the rest waits for the next one."""

    async def main():
        matchmaker = _matchmaker(PEERS[:5], "k:3", lockstep=lockstep)
        loop = asyncio.get_running_loop()
        futures = {}
        for p in PEERS[:4]:  # all four arrive before the former looks
            request = JoinRequest(run=RUN, version=b"v" * 32, step=7)
            futures[p] = loop.create_future()
            matchmaker._pending[p] = _Pending(request, futures[p])
        await matchmaker._form_group()
        groups = {tuple(f.result().group.members) for f in futures.values() if f.done()}
        assert sorted(len(g) for g in groups) == sizes
        await matchmaker.aclose()

    asyncio.run(main())


async def _form(matchmaker: Matchmaker, joins: dict[str, tuple[int, bytes]]) -> dict:
    """Every join in before the former looks; the replies by joiner."""
    loop = asyncio.get_running_loop()
    futures = {}
    for peer, (step, version) in joins.items():
        futures[peer] = loop.create_future()
        matchmaker._pending[peer] = _Pending(JoinRequest(run=RUN, version=version, step=step), futures[peer])
    await matchmaker._form_group()
    return {p: f.result() for p, f in futures.items() if f.done()}


def test_groups_of_bounded_size_split_everyone_in_step_at_random_and_mix():
    """Groups of at most 2: the four joiners at the leading step or a few behind form two groups, drawn
    anew each round; members of another version are in (their models are averaged), and so is one a
    step behind (it takes the group's step). One further behind than MIXING_LAG resyncs from a member."""

    async def main():
        matchmaker = _matchmaker(PEERS, "full", group_size=2)
        draws = set()
        for _ in range(6):
            joins = {p: (7, bytes([i % 2]) * 32) for i, p in enumerate(PEERS[:3])}
            joins |= {PEERS[3]: (6, b"l" * 32), PEERS[4]: (6 - MIXING_LAG, b"b" * 32)}
            replies = await _form(matchmaker, joins)
            groups = {tuple(r.group.members) for r in replies.values() if r.kind == "group"}
            assert sorted(len(g) for g in groups) == [2, 2]
            assert sorted(p for g in groups for p in g) == sorted(PEERS[:4])
            assert all(r.group.mixing for r in replies.values())
            behind = replies[PEERS[4]]
            assert behind.kind == "resync" and behind.donor in PEERS[:4] and behind.group.step == 7
            draws.add(frozenset(frozenset(g) for g in groups))
        assert len(draws) > 1  # (six draws of 3 possible pairings alike: 1 in 243)
        await matchmaker.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("versions, mixing", [(1, False), (2, True)])
def test_a_swarm_within_the_group_size_forms_one_group_that_mixes_only_when_its_models_differ(versions, mixing):
    async def main():
        matchmaker = _matchmaker(PEERS, "full", group_size=8)
        replies = await _form(matchmaker, {p: (3, bytes([i % versions]) * 32) for i, p in enumerate(PEERS)})
        assert {tuple(sorted(r.group.members)) for r in replies.values()} == {tuple(sorted(PEERS))}
        assert {r.group.mixing for r in replies.values()} == {mixing}
        await matchmaker.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    "joins, winner",
    [
        # a peer cut off trained alone to step 900; the three that trained together reached 520
        ([(900, False), (520, True), (520, True), (520, True)], 520),
        # fresh peers (step 0) never restart a swarm, even one that trains alone now
        ([(900, False), (0, False), (0, False), (0, False)], 900),
        # two halves that trained together apart (a split): the higher step
        ([(300, True), (300, True), (480, True), (480, True)], 480),
    ],
)
def test_the_state_trained_together_leads_then_the_higher_step(joins, winner):
    async def main():
        matchmaker = _matchmaker(PEERS[:4], "full")
        tasks = [await _join(matchmaker, p, step=s, together=t) for p, (s, t) in zip(PEERS, joins)]
        replies = [await asyncio.wait_for(t, 5) for t in tasks]
        assert {r.group.step for r in replies} == {winner}
        for (step, _), reply in zip(joins, replies):
            assert reply.kind == ("group" if step == winner else "resync")
        await matchmaker.aclose()

    asyncio.run(main())


def test_a_slow_member_waits_for_k_others_and_is_left_out_when_they_come():
    """k:3 of 4, one peer flagged slow (its parts came in far behind in earlier rounds): the group does not
    close on it with two others while the fourth is on its way; with the fourth in, it resyncs instead."""

    async def main():
        matchmaker = _matchmaker(PEERS[:4], "k:3")
        _flag_slow(matchmaker, PEERS[3])
        joined = [await _join(matchmaker, p, step=5) for p in (PEERS[0], PEERS[1], PEERS[3])]
        assert not any(t.done() for t in joined)  # three at the step, one of them slow: not yet
        fourth = await _join(matchmaker, PEERS[2], step=5)
        replies = {p: await asyncio.wait_for(t, 5) for p, t in zip((PEERS[0], PEERS[1], PEERS[3], PEERS[2]), [*joined, fourth])}
        assert replies[PEERS[3]].kind == "resync"
        assert sorted(replies[PEERS[0]].group.members) == sorted([PEERS[0], PEERS[1], PEERS[2]])
        await matchmaker.aclose()

    asyncio.run(main())


def test_a_slow_member_counts_after_the_wait_when_no_one_else_comes():
    async def main():
        matchmaker = _matchmaker(PEERS[:4], "k:3")
        _flag_slow(matchmaker, PEERS[3])
        loop = asyncio.get_running_loop()
        began = loop.time()
        joined = [await _join(matchmaker, p, step=5) for p in (PEERS[0], PEERS[1], PEERS[3])]
        replies = [await asyncio.wait_for(t, 5) for t in joined]
        assert loop.time() - began >= SLOW_WAIT_S
        assert [r.kind for r in replies] == ["group"] * 3 and len(replies[0].group.members) == 3
        await matchmaker.aclose()

    asyncio.run(main())


def test_the_leaders_own_slow_marks_alone_do_not_make_a_member_wait(monkeypatch):
    """A leader on a lossy link sees everyone's parts come in late and marks them at random; were its marks
    enough, every group it formed would wait SLOW_WAIT_S (one round a second in a k:3 swarm). Here that wait
    is an hour: the group closes at K all the same."""
    monkeypatch.setattr(matchmaking, "SLOW_WAIT_S", 3600.0)

    async def main():
        matchmaker = _matchmaker(PEERS[:4], "k:3")
        matchmaker.link.note_slow(PEERS[1:4])
        assert sorted(matchmaker.link.slow_peers()) == PEERS[1:4]  # published in its record, one voice of three
        joined = [await _join(matchmaker, p, step=5) for p in PEERS[:3]]
        replies = [await asyncio.wait_for(t, 60) for t in joined]
        assert [r.kind for r in replies] == ["group"] * 3
        await matchmaker.aclose()

    asyncio.run(main())


def test_with_fewer_than_k_unflagged_peers_a_group_does_not_wait_and_drops_the_most_named(monkeypatch):
    """Two of four flagged slow under k:3 (a lossy leader's late group replies made a healthy peer look slow
    too): waiting for K unflagged joiners cannot help, so none is waited for (here the wait is an hour); of
    four joiners the group leaves out one of them (the most named first)."""
    monkeypatch.setattr(matchmaking, "SLOW_WAIT_S", 3600.0)

    async def main():
        matchmaker = _matchmaker(PEERS[:4], "k:3")
        view, far = matchmaker.membership._view, get_dht_time() + 3600
        matchmaker.link.note_slow([PEERS[2], PEERS[3]])  # the leader's own
        view[PEERS[1]] = (PeerRecord(state="online", step=0, slow=[PEERS[2], PEERS[3]]), far)
        view[PEERS[2]] = (PeerRecord(state="online", step=0, slow=[PEERS[3]]), far)  # void: PEERS[2] is named itself
        view[PEERS[3]] = (PeerRecord(state="online", step=0, slow=[PEERS[2]]), far)  # (the same)
        assert matchmaker.membership.slow_votes() == {PEERS[2]: 2, PEERS[3]: 2}
        joined = [await _join(matchmaker, p, step=5) for p in (PEERS[0], PEERS[2], PEERS[3])]
        replies = [await asyncio.wait_for(t, 60) for t in joined]
        assert [r.kind for r in replies] == ["group"] * 3
        joined = [await _join(matchmaker, p, step=6) for p in PEERS[:2]]
        joined += [asyncio.create_task(matchmaker._submit(p, JoinRequest(run=RUN, version=bytes([6]) * 32, step=6))) for p in PEERS[2:4]]
        replies = dict(zip(PEERS[:4], [await asyncio.wait_for(t, 60) for t in joined]))
        assert sorted(r.kind for r in replies.values()) == ["group"] * 3 + ["resync"]
        left_out = next(p for p, r in replies.items() if r.kind == "resync")
        assert left_out in PEERS[2:4] and sorted(replies[PEERS[0]].group.members) == sorted(set(PEERS[:4]) - {left_out})
        await matchmaker.aclose()

    asyncio.run(main())


def test_a_join_that_comes_again_gets_the_group_it_was_placed_in():
    """A relayed connection that breaks under a join loses the leader's reply, and the transport sends the
    same join once more: the leader answers it with the group it placed it in, not with the next group
    (meanwhile the members of the first one would wait for the joiner's parts). A new join is a new one."""

    async def main():
        matchmaker = _matchmaker(PEERS[:2], "full")
        first = JoinRequest(run=RUN, version=b"v" * 32, step=3, attempt=b"a" * 16)
        joins = [asyncio.create_task(matchmaker._submit(p, first)) for p in PEERS[:2]]
        placed = [await asyncio.wait_for(t, 5) for t in joins]
        assert placed[1].kind == "group" and sorted(placed[1].group.members) == sorted(PEERS[:2])
        again = await asyncio.wait_for(matchmaker._submit(PEERS[1], first), 5)
        assert again.group.round_id == placed[1].group.round_id
        new = first.model_copy(update={"attempt": b"b" * 16})
        later = asyncio.create_task(matchmaker._submit(PEERS[1], new))
        await asyncio.sleep(0.05)
        assert not later.done()  # held for the next group
        mine = await asyncio.wait_for(matchmaker._submit(PEERS[0], new), 5)
        assert (await asyncio.wait_for(later, 5)).group.round_id == mine.group.round_id != placed[1].group.round_id
        await matchmaker.aclose()

    asyncio.run(main())
