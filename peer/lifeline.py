"""Helper processes that die with the peer that started them.

A SIGKILLed trainer (OOM killer, `kill -9`) runs no cleanup, so its forked DHT process kept running,
and with it p2pd, holding the volunteer's identity: a restart failed with "Identity … is already
taken". A thread in the child polls its parent's pid instead of the Linux parent-death signal,
which fires when the *thread* that forked exits (an executor thread), not the process.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often an orphan looks for its parent: it is gone within about this long


def exit_with_parent(parent_pid: int, cleanup: Callable[[], None], *, poll_s: float = POLL_S) -> threading.Thread:
    """Start a daemon thread that runs `cleanup` and exits this process once `parent_pid` is gone.

    An orphan is re-parented (to init or a subreaper), so `os.getppid()` stops being `parent_pid`; this
    also catches a parent that died before the thread started. `cleanup` must be quick and must not rely
    on this process's event loop, which may be busy or stuck; the process exits (code 1) even if it fails.
    """

    def watch() -> None:
        stop = threading.Event()
        while os.getppid() == parent_pid:
            stop.wait(poll_s)
        logger.warning(f"parent process {parent_pid} is gone; exiting with it")
        try:
            cleanup()
        except Exception as e:
            logger.debug(f"cleanup after the parent's death failed: {e!r}")
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread
