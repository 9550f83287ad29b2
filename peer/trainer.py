"""`phalanx join`'s process: the runtime (peer/runtime.py) running the loop of `--mode` (peer/modes/).

SIGINT/SIGTERM stop the loop between steps and write a final checkpoint (before the node is up, the
process at once: it has nothing to save); SIGUSR1 logs what
every asyncio task and thread is doing (for a peer that seems stuck).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

from phalanx.peer.plan import PeerPlan
from phalanx.peer.modes import mode_info
from phalanx.peer.node import quiet_p2p_daemon_noise
from phalanx.peer.runtime import Report, Runtime

logger = logging.getLogger(__name__)


def dump_stacks() -> None:
    """Write every asyncio task's and thread's stack to stderr."""
    def where(frame) -> str:  # a suspended coroutine's line number can be None (so not print_stack)
        return f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n"

    out = [f"stacks of {len(asyncio.all_tasks())} tasks and {threading.active_count()} threads:\n"]
    for task in asyncio.all_tasks():
        out += [f"--- {task!r}\n", *map(where, task.get_stack(limit=12))]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)}\n")
        for _ in range(12):
            out.append(where(frame))
            if (frame := frame.f_back) is None:
                break
    sys.stderr.write("".join(out))
    sys.stderr.flush()


def run_trainer(plan: PeerPlan) -> Report:
    """Run a trainer until its stop condition or SIGINT/SIGTERM; returns its final report."""
    import uvloop

    mode = mode_info(plan.training.mode).load()

    async def main() -> Report:
        runtime = Runtime(plan)
        loop = asyncio.get_running_loop()

        def stop(sig: signal.Signals) -> None:
            if not runtime.opened:  # still starting (waiting for its initial peers may take minutes): nothing to save
                logger.info(f"{sig.name} before the peer was up: stopping now")
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)  # its DHT process and p2pd follow their parent
            runtime.stop_requested.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        loop.add_signal_handler(signal.SIGUSR1, dump_stacks)
        loop.set_exception_handler(quiet_p2p_daemon_noise)
        return await runtime.run(mode)

    return uvloop.run(main())
