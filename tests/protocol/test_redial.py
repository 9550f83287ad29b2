"""The redialer's schedule: who is lost, when the next dial is due, who is forgotten (no network)."""

from __future__ import annotations

import asyncio
import random

import pytest

from phalanx.protocol.redial import (
    BASE_DELAY_S,
    FORGET_S,
    JITTER,
    LONG_CAP_S,
    LONG_LOST_S,
    OUT_OF_VIEW_S,
    RECENT_CAP_S,
    Redialer,
    parse_initial_peer,
    retry_delay_s,
)

ME = "QmQywTTBm2WuNbCFTQT9Vy4ThyGhYCDJskK1aHLnHdChoV"
BOOT = "QmSz9Tah2m8tBuY4mMrRiUXBAVsPif6xPeEXuecRfaFyCa"
PEER = "QmRZxqmfd6isQRZ7AU9pUc7oTS95Ji2JENyBKsF8ZvdLFR"
BOOT_ADDR = f"/ip4/10.0.0.1/tcp/31337/p2p/{BOOT}"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def redialer(clock: Clock, **kw) -> Redialer:
    return Redialer(None, ME, [BOOT_ADDR], clock=clock, rng=random.Random(0), **kw)


@pytest.mark.parametrize(
    "failures, lost_for_s, lo, hi",
    [
        (0, 0.0, BASE_DELAY_S * (1 - JITTER), BASE_DELAY_S * (1 + JITTER)),
        (1, 5.0, 2 * BASE_DELAY_S * (1 - JITTER), 2 * BASE_DELAY_S * (1 + JITTER)),
        (20, 60.0, RECENT_CAP_S * (1 - JITTER), RECENT_CAP_S * (1 + JITTER)),  # capped at a few seconds
        (20, LONG_LOST_S + 1, LONG_CAP_S * (1 - JITTER), LONG_CAP_S * (1 + JITTER)),  # gone for long: once a minute
    ],
)
def test_retry_delays_double_with_jitter_up_to_a_cap(failures, lost_for_s, lo, hi):
    rng = random.Random(1)
    delays = [retry_delay_s(failures, lost_for_s, rng) for _ in range(200)]
    assert lo <= min(delays) and max(delays) <= hi
    assert len(set(delays)) > 100  # jittered: peers that lost the same bootstrap do not dial it in step


def test_initial_peers_are_parsed_from_their_multiaddr():
    assert parse_initial_peer(BOOT_ADDR) == (BOOT, BOOT_ADDR)


def test_nothing_is_dialed_while_every_known_peer_is_in_view():
    clock = Clock()
    r = redialer(clock)
    for _ in range(10):
        clock.t += 2.0
        r.observe({BOOT: [], PEER: ["/ip4/10.0.0.2/tcp/1/p2p/" + PEER]})
        assert r.due() == []


def test_a_peer_out_of_view_is_dialed_at_its_addresses_until_it_is_back():
    clock = Clock()
    r = redialer(clock)
    r.observe({BOOT: [f"/ip4/10.0.0.9/tcp/31337/p2p/{BOOT}"], PEER: [f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}"]})
    clock.t += OUT_OF_VIEW_S - 0.1
    assert r.due() == []
    clock.t += 0.2
    due = dict(r.due())
    assert due == {
        BOOT: (BOOT_ADDR, f"/ip4/10.0.0.9/tcp/31337/p2p/{BOOT}"),  # its --initial-peers address comes first
        PEER: (f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}",),
    }
    assert r.lost() == sorted([BOOT, PEER])
    r.dialed(BOOT, False)
    r.dialed(PEER, False)
    assert r.due() == []  # backed off
    clock.t += 2 * BASE_DELAY_S * (1 + JITTER)
    assert sorted(p for p, _ in r.due()) == sorted([BOOT, PEER])
    r.observe({PEER: []})  # its records are back: no more dials
    assert [p for p, _ in r.due()] == [BOOT]
    assert r.stats.dials == 2 and r.stats.answered == 0


def test_an_answer_resets_the_backoff_but_only_records_bring_a_peer_back():
    clock = Clock()
    r = redialer(clock)
    clock.t += OUT_OF_VIEW_S + 1
    assert [p for p, _ in r.due()] == [BOOT]
    for _ in range(6):
        r.dialed(BOOT, False)
    assert r.known[BOOT].next_dial_at - clock.t >= RECENT_CAP_S * (1 - JITTER)
    r.dialed(BOOT, True)
    assert r.known[BOOT].next_dial_at - clock.t <= BASE_DELAY_S * (1 + JITTER)
    assert r.lost() == [BOOT]


def test_peers_that_left_cleanly_or_long_ago_are_forgotten_but_initial_peers_never():
    clock = Clock()
    r = redialer(clock)
    other = "QmcxMvAr22AE2MPRjkFBy2pZBUNup3rTs3AZzGTpQ5xSsj"
    r.observe({PEER: [], other: []})
    r.observe({}, gone=[PEER, BOOT])  # a clean goodbye; an initial peer is dialed even after one
    assert sorted(r.known) == sorted([BOOT, other])
    clock.t += OUT_OF_VIEW_S + 1
    r.due()
    clock.t += FORGET_S + 1
    assert [p for p, _ in r.due()] == [BOOT]
    assert sorted(r.known) == [BOOT]


def test_it_never_dials_itself():
    clock = Clock()
    r = Redialer(None, BOOT, [BOOT_ADDR], clock=clock)
    r.observe({BOOT: []})
    clock.t += OUT_OF_VIEW_S + 1
    assert r.due() == [] and r.known == {}


def test_a_tick_polls_the_watch_for_the_membership_view():
    clock = Clock()
    r = redialer(clock, watch=lambda: ({PEER: []}, []))
    asyncio.run(r.tick())
    assert PEER in r.known and r.known[PEER].seen_at == clock.t


def test_each_due_peer_is_dialed_in_its_own_task_and_rescheduled_when_it_ends(monkeypatch):
    import phalanx.protocol.redial as redial

    started: list[str] = []
    release = asyncio.Event()

    async def fake_in_dht(_dht, call, timeout):
        (peer, _), = call.keywords["targets"]
        started.append(peer)
        if peer == BOOT:
            await release.wait()  # a dial into a partition: hangs until its timeout
            return []
        return [peer]

    monkeypatch.setattr(redial, "in_dht", fake_in_dht)

    async def main() -> None:
        clock = Clock()
        r = Redialer(object(), ME, [BOOT_ADDR], clock=clock, rng=random.Random(0))
        r.observe({PEER: []})
        clock.t += OUT_OF_VIEW_S + 1
        await r.tick()
        await asyncio.sleep(0)
        assert sorted(started) == sorted([BOOT, PEER])
        assert r.known[PEER].next_dial_at < float("inf") and r.stats.answered == 1  # not held up by BOOT
        await r.tick()
        assert len(started) == 2  # BOOT still in flight: not dialed twice
        release.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert r.known[BOOT].failures == 1 and r.stats.dials == 2
        await r.aclose()

    asyncio.run(main())
