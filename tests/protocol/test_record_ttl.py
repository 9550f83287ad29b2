"""A peer's record lives through CYCLES_PER_TTL of its refreshes: on a machine so loaded that announcing and
reading back took longer than `ttl_s`, every record had expired by the time the read came back."""

import asyncio

from phalanx.protocol.membership import CYCLES_PER_TTL, MAX_TTL_S, Membership


def test_the_record_lives_ttl_s_or_as_many_refreshes_as_it_must_up_to_the_cap():
    view = Membership(None, "k.peers", "me")
    assert view.record_ttl_s == view.ttl_s  # nothing measured yet
    view._cycle_s = 0.05
    assert view.record_ttl_s == view.ttl_s  # a quick refresh: a dead peer still leaves every view within ttl_s
    view._cycle_s = 12.0
    assert view.record_ttl_s == CYCLES_PER_TTL * 12.0
    view._cycle_s = 100.0
    assert view.record_ttl_s == MAX_TTL_S  # what DHT nodes accept


def test_a_slow_refresh_announces_the_next_record_for_longer():
    view = Membership(None, "k.peers", "me")
    announced = []

    async def announce(expire_in_s):
        announced.append(expire_in_s)
        await asyncio.sleep(0.2)

    async def read():
        await asyncio.sleep(0.2)

    view._announce, view._read = announce, read
    view.ttl_s = 0.5

    async def main():
        await view.refresh()
        await view.refresh()

    asyncio.run(main())
    assert announced[0] == 0.5 and announced[1] >= CYCLES_PER_TTL * 0.4
