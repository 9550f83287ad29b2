"""Calls into hivemind's DHT process that end when that process dies, on keys that have a validator.

hivemind answers through futures that nothing resolves once its DHT process is gone (killed,
out of memory, or stopped by a Ctrl-C or killpg that reached the whole process group): an
await on one would never return, and a thread blocked on one keeps the program from exiting.
The DHT is open to strangers, so `dht_get` and `dht_store` refuse a key whose validator was not
installed on that DHT node (`validate_keys`; peer/dht_keys.py is the table of a run's keys).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from functools import partial
from typing import Any, Callable, Optional

import hivemind

from phalanx.errors import PhalanxError

DHT_DIED = "the DHT process died (killed, or out of memory?)"
LIVENESS_CHECK_S = 1.0

_validated: weakref.WeakKeyDictionary[hivemind.DHT, set[str]] = weakref.WeakKeyDictionary()


async def settled(dht: hivemind.DHT, start: Callable[[], Any], timeout: Optional[float] = None) -> Any:
    """The result of the MPFuture that `start()` sends to the DHT process; PhalanxError once that
    process is dead (checked before sending, then every second)."""
    if not dht.is_alive():
        raise PhalanxError(DHT_DIED)
    call = asyncio.ensure_future(start())
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not call.done():
            if not dht.is_alive():
                raise PhalanxError(DHT_DIED)
            wait = LIVENESS_CHECK_S if deadline is None else min(LIVENESS_CHECK_S, deadline - time.monotonic())
            if wait <= 0:
                raise asyncio.TimeoutError(f"the DHT process did not answer within {timeout:g} s")
            await asyncio.wait({call}, timeout=wait)
        return call.result()
    finally:
        call.cancel()


async def in_dht(dht: hivemind.DHT, coro: Callable, timeout: float = 30.0) -> Any:
    """Await `coro(dht, node)` run in the DHT's process."""
    return await settled(dht, lambda: dht.run_coroutine(coro, return_future=True), timeout)


async def validate_keys(dht: hivemind.DHT, validators: dict[str, Any]) -> None:
    """Make `dht`'s node refuse what each key's validator refuses ({raw key: validator}), and let
    `dht_get`/`dht_store` use those keys."""
    await in_dht(dht, partial(_extend, validators=list(validators.values())))
    _validated.setdefault(dht, set()).update(validators)


async def _extend(_dht: hivemind.DHT, node: Any, validators: list) -> None:
    node.protocol.record_validator.extend(validators)


def validated_keys(dht: hivemind.DHT) -> frozenset[str]:
    return frozenset(_validated.get(dht, ()))


def _checked(dht: hivemind.DHT, key: str) -> str:
    if key not in _validated.get(dht, ()):
        raise PhalanxError(f"DHT key {key!r} has no validator on this node (every key a run uses is in peer/dht_keys.py)")
    return key


async def dht_get(dht: hivemind.DHT, key: str) -> Any:
    """The latest value of `key` (all its subkeys), as hivemind's DHT.get returns it."""
    _checked(dht, key)
    return await settled(dht, lambda: dht.get(key, latest=True, return_future=True))


async def dht_store(dht: hivemind.DHT, key: str, value: Any, expiration: float, *, subkey: str) -> bool:
    _checked(dht, key)
    return await settled(dht, lambda: dht.store(key, value, expiration, subkey=subkey, return_future=True))

