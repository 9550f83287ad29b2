"""The event loop the node lives on, on a thread of its own: `phalanx.Optimizer` keeps the caller's
thread for training, and the caller waits on the loop's results only while a round must land."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from phalanx.peer.node import quiet_p2p_daemon_noise

T = TypeVar("T")


class SwarmLoop:
    def __init__(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.loop.set_exception_handler(quiet_p2p_daemon_noise)
        self.thread = threading.Thread(target=self.loop.run_forever, name="phalanx-swarm", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what still runs on the loop (a round's reducer left behind, say) and wait for it, so no
        task is destroyed pending; then stop the loop and its thread."""

        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.wait(rest, timeout=10) if rest else None

        if self.thread.is_alive() and not self.loop.is_closed():
            try:
                self.submit(cancel_the_rest()).result(timeout=15)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()
