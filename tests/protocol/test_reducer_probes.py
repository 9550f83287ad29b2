"""Once our own part is reduced, a reducer that still owes us its part is probed: one that stops
answering (cut off, frozen) is given up on at once, one that answers (waiting on a slow sender itself)
is waited for. `_await_calls` with stand-in calls and probes; no network."""

import asyncio

from phalanx.protocol.allreduce import REDUCER_PROBE_S, _await_calls, _outcome
from phalanx.protocol.channel import Activity
from phalanx.protocol.transport import CallFailed


async def _done() -> None:
    pass


def test_a_reducer_that_leaves_a_probe_unanswered_is_given_up_on_long_before_the_idle_limit():
    async def main():
        loop = asyncio.get_running_loop()
        calls = {1: loop.create_future(), 2: loop.create_future()}  # 1: cut off; 2: slow but alive
        probed: list[int] = []

        async def probe(j: int) -> bool:
            probed.append(j)
            if j == 1:
                raise CallFailed("alive to …x timed out after 4.0 s")
            return False  # still waiting for our part (or holding its aggregate for us)

        reduced = asyncio.ensure_future(_done())
        started = loop.time()
        loop.call_later(2.5 * REDUCER_PROBE_S, calls[2].set_result, (b"", b""))
        stalled, unreachable, dropped_us = await _await_calls(
            calls, {1: Activity(), 2: Activity()}, reduced, idle_s=600.0, probe=probe
        )
        return stalled, unreachable, dropped_us, loop.time() - started, probed, calls

    stalled, unreachable, dropped_us, took, probed, calls = asyncio.run(main())
    assert (stalled, unreachable, dropped_us) == ([1], [1], [])
    assert took < 10.0  # the idle limit alone would have waited 2 × 600 s
    assert probed.count(2) >= 2 and calls[2].done() and not calls[2].cancelled()  # answered: kept waiting
    assert "liveness probe unanswered" in str(_outcome(calls[1], True, 600.0, unreachable=True))


def test_without_probes_only_the_idle_limit_ends_the_wait():
    async def main():
        loop = asyncio.get_running_loop()
        calls = {1: loop.create_future()}
        return await _await_calls(calls, {1: Activity()}, asyncio.ensure_future(_done()), idle_s=0.5)

    assert asyncio.run(main()) == ([1], [], [])


def test_a_reducer_that_stopped_waiting_for_our_part_is_given_up_on_at_its_answer():
    """A lossy link from us to a reducer: it dropped our part (its bytes never came) and will send no
    aggregate; its answer to the probe ends the wait instead of the idle limit."""

    async def main():
        loop = asyncio.get_running_loop()
        calls = {1: loop.create_future(), 2: loop.create_future()}  # 1: dropped us; 2: answers later
        loop.call_later(2.5 * REDUCER_PROBE_S, calls[2].set_result, (b"", b""))
        started = loop.time()
        result = await _await_calls(
            calls, {1: Activity(), 2: Activity()}, asyncio.ensure_future(_done()), idle_s=600.0,
            probe=lambda j: _answer(j == 1),
        )  # fmt: skip
        return result, loop.time() - started, calls

    (stalled, unreachable, dropped_us), took, calls = asyncio.run(main())
    assert (stalled, unreachable, dropped_us) == ([1], [], [1])
    assert took < 10.0 and calls[1].cancelled() and calls[2].done() and not calls[2].cancelled()
    assert "stopped waiting for our part" in str(_outcome(calls[1], True, 600.0, dropped_us=True))


async def _answer(dropped: bool) -> bool:
    return dropped


def test_a_reducer_says_whether_it_still_waits_for_a_senders_part():
    """What `_serve_alive` answers: waiting while the part may still come or its aggregate is owed;
    not waiting once the sender was dropped or the round closed without it, also after the round is
    forgotten; a round it does not know is left to the caller's other limits."""
    from phalanx.protocol.allreduce import AllReduceService
    from phalanx.protocol.reduction import Reduction
    from phalanx.protocol.round_spec import AliveQuery, AliveReply
    from phalanx.security.wire import pack, unpack

    members = ("peer-a", "peer-b", "peer-c")
    rid, other = b"r" * 16, b"o" * 16
    service = AllReduceService.__new__(AllReduceService)
    service._rounds, service._registered, service._closed, service._answered = {}, {}, {}, {}
    reduction = Reduction.__new__(Reduction)
    reduction.spec = type("Spec", (), {"members": members})()
    reduction.received, reduction.refused, reduction.closed = {0, 1}, set(), False
    reduction.digests, reduction.answers = {}, {}
    reduction.release = lambda: None
    service._rounds[rid] = reduction

    def waiting(peer: str, round_id: bytes = rid) -> bool:
        header, payload = asyncio.run(service._serve_alive(peer, pack(AliveQuery(round_id=round_id)), bytearray()))
        assert payload == b""
        return unpack(header, AliveReply).waiting

    assert waiting("peer-b") and waiting("peer-c")  # b's part is in; c's may still come
    reduction.refused.add(2)  # c's bytes stopped: dropped
    assert waiting("peer-b") and not waiting("peer-c")
    reduction.refused.clear()
    reduction.closed = True  # closed at the deadline without c
    assert waiting("peer-b") and not waiting("peer-c")
    service._forget(rid)
    assert rid not in service._rounds
    assert waiting("peer-b") and not waiting("peer-c")
    assert waiting("peer-c", other) and waiting("stranger")  # unknown round, unknown peer
    assert asyncio.run(service._serve_alive("peer-c", b"", bytearray())) == (b"", b"")  # a bare liveness probe


def test_a_sender_far_behind_the_others_is_slow_a_few_milliseconds_are_not():
    from phalanx.protocol.reduction import Reduction

    reduction = Reduction.__new__(Reduction)
    reduction.my_index = 0
    reduction.arrived_at = {0: 100.0, 1: 100.010, 2: 100.030, 3: 101.8}  # started at 100.0
    assert reduction.slow(100.0) == [3]
    reduction.arrived_at = {0: 100.0, 1: 100.010, 2: 100.060}  # a busy machine's 50 ms are not slow
    assert reduction.slow(100.0) == []
    reduction.arrived_at = {0: 100.0, 1: 100.200, 2: 100.600}  # nor 0.4 s behind a sender that took 0.2 s
    assert reduction.slow(100.0) == []
    reduction.arrived_at = {0: 100.0, 3: 103.0}  # one other sender: nobody to compare with
    assert reduction.slow(100.0) == []
