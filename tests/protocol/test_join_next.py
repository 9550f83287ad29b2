"""A sync round joins the next one while it runs (RoundRequest.next_follows): the next group is formed
by the time the round lands, and taken only when the state it was joined with is the one this peer
holds. Plain and verified rounds alike; real peers on loopback."""

import asyncio

import pytest
import torch

from phalanx.protocol.config import RoundConfig
from phalanx.protocol.engine import Averaged, Resync, RoundRequest, next_version
from tests.protocol.btard.btard_rounds import CONFIG as VERIFIED
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
N = 3
configs = pytest.mark.parametrize("config", [RoundConfig(), VERIFIED], ids=["plain", "verified"])


def _record_joins(peer, joins: list[tuple[int, bool]]) -> None:
    """Note each join's step, and whether the peer was inside a round when it sent it."""
    join = peer.engine.matchmaker.join

    async def recorded(**kwargs):
        joins.append((kwargs["step"], peer.engine.in_group))
        return await join(**kwargs)

    peer.engine.matchmaker.join = recorded


async def _rounds(peers, count: int, *, follows: bool = True, complete: bool = True) -> list[list[Averaged]]:
    out = []
    for r in range(count):
        xs = [torch.full((100,), float(i + r)) for i in range(len(peers))]
        outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x, next_follows=follows)) for p, x in zip(peers, xs)])
        assert all(isinstance(o, Averaged) and not o.result.missing_parts for o in outcomes), outcomes
        if complete:
            for peer, outcome in zip(peers, outcomes):
                await peer.engine.completed(outcome, dict)
        out.append(outcomes)
    return out


@configs
def test_each_round_after_the_first_was_joined_during_the_one_before(config):
    async def main():
        async with open_swarm(N, config) as peers:
            joins = {p.peer_id: [] for p in peers}
            for p in peers:
                _record_joins(p, joins[p.peer_id])
            rounds = await _rounds(peers, 4)
            for outcomes in rounds:
                assert len({o.group.round_id for o in outcomes}) == 1 and len(outcomes[0].group.members) == N
                assert all((o.result.vector == outcomes[0].result.vector).all() for o in outcomes)
            assert len({p.engine.version for p in peers}) == 1
            for peer_joins in joins.values():
                # the first join before any round; every later one sent from inside the round before it
                assert peer_joins[0] == (0, False), peer_joins
                assert peer_joins[1:] == [(s, True) for s in range(1, 5)], peer_joins
            # a caller that does not follow at once: its next round takes the group joined during the last one,
            # and the round after joins only once it is asked for
            for p in peers:
                joins[p.peer_id].clear()
            await _rounds(peers, 2, follows=False)
            for peer_joins in joins.values():
                assert peer_joins == [(5, False)], peer_joins

    asyncio.run(main())


@configs
def test_a_state_other_than_the_one_joined_with_joins_anew_and_the_rounds_go_on(config):
    """Every member ends the round with another state than a whole round gives (as when a reducer's part
    did not come back): the group joined early is not taken, a new one forms, and everyone agrees."""

    async def main():
        async with open_swarm(N, config) as peers:
            (first,) = await _rounds(peers, 1, complete=False)
            for peer, outcome in zip(peers, first):
                peer.engine.set_state(next_version(peer.engine.version, outcome.group.round_id, (0,)), peer.engine.step + 1)
            early = [peer.engine._next.task for peer in peers]
            (second,) = await _rounds(peers, 1, follows=False)
            early_ids = {t.result().group.round_id for t in early if t.done() and not t.cancelled() and t.exception() is None}
            assert second[0].group.round_id not in early_ids
            assert len({o.group.round_id for o in second}) == 1 and len(second[0].group.members) == N
            assert len({p.engine.version for p in peers}) == 1
            # a group dropped will have no state after it: peers told to resync from us hear so at once
            for peer, task in zip(peers, early):
                if task.done() and not task.cancelled() and task.exception() is None:
                    assert task.result().group.round_id in peer.engine.state._abandoned

    asyncio.run(main())


@configs
def test_a_peer_leaving_after_joining_early_takes_part_with_nothing_and_the_round_is_whole(config):
    """A peer that closes while in a group it joined early runs that round at weight 0, or sits a verified
    round out (RoundEngine.leave): the others get every part, their own aggregate, and wait for no one."""

    async def main():
        async with open_swarm(N, config) as peers:
            await _rounds(peers, 1)
            staying, leaving = peers[:-1], peers[-1]
            xs = [torch.full((100,), float(i + 1)) for i in range(len(staying))]
            outcomes, _ = await asyncio.gather(
                asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(staying, xs)]), leaving.engine.leave()
            )
            for outcome in outcomes:
                assert isinstance(outcome, Averaged) and len(outcome.group.members) == N
                assert outcome.result.missing_parts == () and outcome.result.dropped_senders == (), outcome.result
                if config.verify is None:
                    assert torch.allclose(outcome.result.vector, torch.stack(xs).mean(0))
                else:  # the leaver's zeros count nowhere: CenteredClip of the two others, around their mean
                    assert not outcome.verdict.banned
                    assert torch.equal(outcome.result.vector, outcomes[0].result.vector)
                    assert (outcome.result.vector > 0.5).all()

    asyncio.run(main())


@configs
def test_a_peer_told_to_resync_joins_the_next_round_with_the_state_it_downloads(config):
    """The round's recipient joins the next round as its members do, with the state a whole round leads
    to: under a sync policy of K the members' early joins fill the next group at once, and a recipient
    joining only after its download was told to resync again, round after round."""

    async def main():
        async with open_swarm(N + 1, config) as peers:
            members, late = peers[:N], peers[N]
            await _rounds(peers, 1, follows=False)
            late.engine.set_state(b"fell behind", 0)
            joins: list[tuple[int, bool]] = []
            _record_joins(late, joins)
            xs = [torch.full((100,), float(i)) for i in range(N + 1)]
            outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x, next_follows=True)) for p, x in zip(peers, xs)])
            *averaged, resync = outcomes
            assert isinstance(resync, Resync) and all(isinstance(o, Averaged) for o in averaged), outcomes
            for peer, outcome in zip(members, averaged):
                await peer.engine.completed(outcome, lambda p=peer: {"w": torch.full((3,), float(p.engine.step))})
            # joined the next round on the reply, before the download: at the step the donor's state has
            assert resync.group.step == 1 and joins == [(0, False), (2, False)], joins
            snapshot = await late.engine.fetch_state(resync, {"w": torch.zeros(3)})
            late.engine.set_state(snapshot.version, snapshot.step, together=resync.together)
            assert (late.engine.version, late.engine.step) == (members[0].engine.version, members[0].engine.step)
            (together,) = await _rounds(peers, 1, follows=False)
            assert len(together[0].group.members) == N + 1 and len({o.group.round_id for o in together}) == 1
            assert joins == [(0, False), (2, False)], joins  # the round was the one joined early

    asyncio.run(main())


@configs
def test_a_member_suspected_before_the_early_join_does_not_make_a_peer_drop_the_group(config):
    """A peer that suspected a member before it joined the next round early (a restarted peer, which the
    leader put in the group on its own join since) takes the group: only evidence from round s counts."""

    async def main():
        async with open_swarm(N, config) as peers:
            by_id = sorted(peers, key=lambda p: p.peer_id)
            doubter, suspected = by_id[-1], by_id[1]  # (neither the lowest ID, which leads unverified rounds)
            doubter.engine.membership.suspect(suspected.peer_id, for_s=120.0)
            joins: list[tuple[int, bool]] = []
            _record_joins(doubter, joins)
            rounds = await _rounds(peers, 2)
            assert joins == [(0, False), (1, True), (2, True)], joins  # round 2: the group joined during round 1
            assert all(len(o.group.members) == N for outcomes in rounds for o in outcomes)

    asyncio.run(main())


def test_a_peer_alone_in_the_group_it_joined_early_leaves_without_running_it(caplog):
    """Nobody waits for the parts of a peer alone in its next group: leaving, it runs no round (at weight 0
    it had only zeros to aggregate, which failed) and marks the round abandoned for would-be recipients."""

    async def main():
        async with open_swarm(1, RoundConfig()) as (peer,):
            await _rounds([peer], 1)
            early = peer.engine._next.task
            await peer.engine.leave()
            assert early.result().group.members == [peer.peer_id]
            assert early.result().group.round_id in peer.engine.state._abandoned

    with caplog.at_level("INFO", logger="phalanx"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "failed" in r.getMessage() or "contributing nothing" in r.getMessage()]
