"""The validator of a verified round (protocol/btard/validator.py): it checks its target while the gather
runs, and catches a reducer that covers up its aggregate with its own report."""

import asyncio
import dataclasses

import pytest
import torch

from phalanx.protocol.adversary import PROTOCOL_ATTACKS
from phalanx.protocol.engine import RoundRequest, Verification
from tests.protocol.btard.btard_rounds import CONFIG, inputs
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
# every member here answers every phase, so no phase waits its timeout out: a long one costs nothing, and a
# loaded machine once took more than CONFIG's 3 s for a cover-up's phases (the validator then proved nothing)
PATIENT = dataclasses.replace(CONFIG, verify=dataclasses.replace(CONFIG.verify, phase_timeout_s=15.0))


def verified(x, **verification) -> RoundRequest:
    return RoundRequest(x, verification=Verification(**verification))


def test_validator_checks_its_target_while_the_gather_runs(monkeypatch):
    """The validator starts as soon as the seed is public (mid-gather): a recomputation that is not
    bit-identical fetches the target's parts from reducers, who hold them from the moment they signed
    their aggregate; an honest target passes, a target that sent another gradient is banned."""
    from phalanx.protocol.btard.validator import Validator

    async def main():
        async with open_swarm(4, PATIENT) as peers:
            ids = [p.peer_id for p in peers]
            target = [ids[1]]
            monkeypatch.setattr(Validator, "pairs", lambda self, seed: [(ids[0], target[0])])
            numel = 2_000_000  # 2 MB parts: the aggregates take the direct path, so the seed is out before they land
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(4)]
            honest = {p: x for p, x in zip(ids, xs)}

            async def recompute(peer):  # the same gradient up to float noise from other hardware
                return honest[peer] * (1 + 1e-7)

            async def verified_round(sent):
                for peer in peers:
                    peer.engine.set_state(b"v0", 0)
                return await asyncio.gather(*[p.engine.run_round(verified(x, recompute=recompute)) for p, x in zip(peers, sent)])

            outcomes = await verified_round(xs)
            assert all(o.verdict.clean and o.verdict.banned == set() for o in outcomes), [o.verdict for o in outcomes]

            target[0] = ids[3]
            outcomes = await verified_round(xs[:3] + [-xs[3]])  # peer 3 commits to and sends a flipped gradient
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert outcome.verdict.banned == {ids[3]} and peer.membership.banned == {ids[3]}

    asyncio.run(main())


@pytest.mark.parametrize("recomputation", ["bit-identical", "other hardware"])
def test_a_reducer_covering_up_its_aggregate_with_its_own_report_is_caught_by_the_validator(monkeypatch, recomputation):
    """Only a reducer holds its own part, so its report on it is checked by nobody but the validator that
    targets it: a shifted aggregate covered up by that report passes the fixed-point check, and the
    validator (who holds the target's committed parts) proves the lie."""
    from phalanx.protocol.btard.validator import Validator

    async def main():
        behaviors = [None, None, None, PROTOCOL_ATTACKS["cover_up"]()]
        async with open_swarm(4, PATIENT, behaviors=behaviors) as peers:
            ids = [p.peer_id for p in peers]
            target = [ids[1]]
            monkeypatch.setattr(Validator, "pairs", lambda self, seed: [(ids[0], target[0])])
            xs = inputs(4)
            committed = dict(zip(ids, xs))
            noise = 1.0 if recomputation == "bit-identical" else 1 + 1e-7

            async def recompute(peer):
                return committed[peer] * noise

            async def verified_round():
                for peer in peers:
                    peer.engine.set_state(b"v0", 0)
                return await asyncio.gather(*[p.engine.run_round(verified(x, recompute=recompute)) for p, x in zip(peers, xs)])

            # validating someone else, nobody can tell: the wrong aggregate is applied
            outcomes = await verified_round()
            assert all(o.verdict.clean for o in outcomes), [o.verdict for o in outcomes]

            target[0] = ids[3]
            outcomes = await verified_round()
            at = outcomes[0].group.members.index(ids[3])
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert outcome.verdict.banned == {ids[3]} and peer.membership.banned == {ids[3]}
                assert outcome.verdict.bad_parts == {at}

    asyncio.run(main())


def test_with_a_validator_per_member_a_cover_up_is_caught_in_its_first_round():
    """`validators` equal to the group size: every member is some validator's target each round, so the
    reducer that covers up its shifted aggregate with its own report is caught whatever the seed."""
    config = dataclasses.replace(PATIENT, verify=dataclasses.replace(PATIENT.verify, validators=4))

    async def main():
        async with open_swarm(4, config, behaviors=[None, None, None, PROTOCOL_ATTACKS["cover_up"]()]) as peers:
            ids = [p.peer_id for p in peers]
            xs = inputs(4)
            committed = dict(zip(ids, xs))

            async def recompute(peer):
                return committed[peer]

            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            outcomes = await asyncio.gather(*[p.engine.run_round(verified(x, recompute=recompute)) for p, x in zip(peers, xs)])
            at = outcomes[0].group.members.index(ids[3])
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert outcome.verdict.banned == {ids[3]} and peer.membership.banned == {ids[3]}
                assert outcome.verdict.bad_parts == {at}

    asyncio.run(main())


def test_a_validators_recomputation_is_freed_with_its_round(monkeypatch):
    """The data phase keeps the round as its part guard a few seconds longer (late parts), into the next
    round; the validator's recomputation (a whole vector) must not stay with it: at 100M values it was
    a copy of the vector more per peer, every round this peer validated."""
    import gc

    from phalanx.protocol.btard.validator import Validator

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            ids = [p.peer_id for p in peers]
            monkeypatch.setattr(Validator, "pairs", lambda self, seed: [(ids[0], ids[1])])
            xs = inputs(4)
            made = []

            async def recompute(peer):
                value = xs[ids.index(peer)].clone()  # bit-identical: its parts are kept as views of it
                made.append(peer)
                return value

            def copies_of(x):
                """Storages alive elsewhere (through any view of them) that hold x's values whole."""
                gc.collect()
                found = {}
                for o in gc.get_objects():
                    if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                        storage = o.untyped_storage()
                        if storage.nbytes() == x.numel() * 4 and storage.data_ptr() != x.untyped_storage().data_ptr():
                            whole = torch.empty(0).set_(storage, 0, (x.numel(),))
                            if torch.equal(whole, x):
                                found[storage.data_ptr()] = o.shape
                return found

            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            outcomes = await asyncio.gather(*[p.engine.run_round(verified(x, recompute=recompute)) for p, x in zip(peers, xs)])
            assert all(o.verdict.clean for o in outcomes), [o.verdict for o in outcomes]
            assert made == [ids[1]]
            assert peers[0].engine.allreduce.has_round(outcomes[0].group.round_id)  # the guard is still held
            assert not copies_of(xs[1]), "the validator's recomputation outlived its round"

    asyncio.run(main())


def test_a_validator_whose_recomputation_outlasts_the_phase_timeouts_is_waited_for(monkeypatch):
    """A diloco validator replays H inner steps: minutes at real sizes, against a phase timeout of
    seconds. Members wait for accusations (and for the judges' own replays before the votes) as long
    as their own recomputation takes, twice over; without that the others gave up on the validator,
    judged without its accusation, and a peer that sent a flipped contribution was never banned (this
    test with `recompute_s` 0: peers 1 and 2 banned nobody)."""
    from phalanx.protocol.btard.validator import Validator

    config = dataclasses.replace(CONFIG, verify=dataclasses.replace(CONFIG.verify, phase_timeout_s=0.3))
    recompute_s = 1.0  # the recomputation below sleeps 1.5 s: beyond the two 0.3 s phases, within 2 × 1.0 s more

    async def main():
        async with open_swarm(4, config) as peers:
            ids = [p.peer_id for p in peers]
            monkeypatch.setattr(Validator, "pairs", lambda self, seed: [(ids[0], ids[3])])
            xs = inputs(4)
            honest = dict(zip(ids, xs))

            async def recompute(peer):
                await asyncio.sleep(1.5)
                return honest[peer]

            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            sent = xs[:3] + [-xs[3]]  # peer 3 commits to and sends a flipped contribution
            outcomes = await asyncio.gather(*[
                p.engine.run_round(verified(x, recompute=recompute, recompute_s=recompute_s))
                for p, x in zip(peers, sent)
            ], return_exceptions=True)  # fmt: skip
            return ids, outcomes

    ids, outcomes = asyncio.run(main())
    banned = [o.verdict.banned if not isinstance(o, BaseException) else o for o in outcomes[:3]]
    assert banned == [{ids[3]}] * 3, banned


SIT_OUT = dataclasses.replace(CONFIG, verify=dataclasses.replace(CONFIG.verify, validators_sit_out=True))


@pytest.mark.parametrize("case", ["honest target", "forged contribution", "false accusation"])
def test_a_validator_sitting_out_checks_the_member_it_picked(case):
    """validators_sit_out (DiLoCo): a member sits the round out with its target's contribution recomputed
    beforehand; it alone may accuse that member of a bad contribution, and the judges' own recomputation
    decides between them. Nobody is drawn by the seed: a member that did not sit out validates nobody."""

    async def main():
        async with open_swarm(4, SIT_OUT) as peers:
            ids = [p.peer_id for p in peers]
            sitter, target = ids[0], ids[3]
            xs = inputs(4)
            honest = dict(zip(ids, xs))
            sent = xs[:3] + [-xs[3] if case == "forged contribution" else xs[3]]

            def recompute_for(me):
                async def recompute(peer):
                    if me == sitter and case == "false accusation":
                        return -honest[peer]  # the sitter's replay went wrong: its accusation is false
                    return honest[peer]

                return recompute

            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            outcomes = await asyncio.gather(
                *[
                    p.engine.run_round(verified(x, recompute=recompute_for(p.peer_id), sit_out=p.peer_id == sitter, target=target))
                    for p, x in zip(peers, sent)
                ]
            )
            expected = {"honest target": set(), "forged contribution": {target}, "false accusation": {sitter}}[case]
            for peer, outcome in zip(peers, outcomes):
                if peer.peer_id in expected:
                    continue
                assert outcome.verdict.banned == expected, (case, outcome.verdict)
                assert outcome.verdict.clean == (case == "honest target")
                assert outcome.verdict.contributors == tuple(sorted(set(ids) - {sitter}))
                assert outcome.verdict.seed

    asyncio.run(main())


def test_a_round_seed_draws_at_most_a_third_of_its_members_to_sit_out():
    """Sitters do not contribute: two of four sitting out would leave one attacker half of the contributors."""
    from phalanx.protocol.btard.validator import drawn_to_sit_out

    members = [f"peer-{i}" for i in range(7)]
    for seed in (b"a", b"b", b"c"):
        assert drawn_to_sit_out(seed, members[:4], 2) <= set(members[:4])
        assert len(drawn_to_sit_out(seed, members[:4], 2)) == 1
        assert len(drawn_to_sit_out(seed, members[:6], 2)) == 2
        assert len(drawn_to_sit_out(seed, members[:7], 5)) == 2
        assert drawn_to_sit_out(seed, members[:2], 1) == set()  # two members: nobody can sit out
        assert drawn_to_sit_out(seed, members[:6], 2) == drawn_to_sit_out(seed, list(reversed(members[:6])), 2)
