"""`--mode sync`: one all-reduced gradient per step.

    compute gradient on (seed, peer, step)'s batch   (worker thread)
    round: matchmaking + butterfly all-reduce        (event loop)
    apply the aggregate with the optimizer            (worker thread, never cancelled)

A peer that the leader finds out of sync downloads a donor's state instead of applying.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Optional

import torch

from phalanx.aggregation.errors import PhalanxError
from phalanx.peer.runtime import Runtime
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, Resync

logger = logging.getLogger(__name__)


class SyncMode:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.engine = runtime, runtime.engine
        self._validator_model: Optional[torch.nn.Module] = None  # a copy: recomputation must not touch BatchNorm stats

    @property
    def step(self) -> int:
        return self.engine.step  # every step is a round: the engine's count is ours

    async def run(self) -> None:
        runtime, engine, model = self.runtime, self.engine, self.runtime.model
        failures = 0
        while not runtime.done(engine.step) and await runtime.check_node():
            step = engine.step
            loss, grad = await runtime.in_thread(runtime.contribution, step)
            round_task = await runtime.run_unless_stopped(engine.run_round(grad.to("cpu"), recompute=self._recompute))
            if round_task is None:
                break
            try:
                outcome = round_task.result()
            except ROUND_FAILURES as e:
                runtime.round_failed(e, f"round at step {step}", level=logging.WARNING)
                failures += 1
                # back off, so a peer the swarm refuses does not spin: 0.1 s, doubling up to 5 s
                await runtime.sleep_or_stop(min(5.0, 0.1 * 2 ** min(failures, 6)))
                continue
            failures = 0
            if isinstance(outcome, Resync):
                await self._resync(outcome)
                continue
            # applying is never cancelled halfway: the model is either before or after this step
            await asyncio.shield(runtime.in_thread(model.apply, outcome.result.vector, step))
            await engine.completed(outcome, model.state_tensors)
            await self._step_done(loss, outcome)

    async def _step_done(self, loss: float, outcome: Averaged) -> None:
        runtime, result, members = self.runtime, outcome.result, len(outcome.group.members)
        step = self.engine.step
        runtime.report.group_size = members
        duration_s = self.engine.stats.last_round_s
        runtime.health.round_done(step=step, loss=loss, samples=runtime.batch_size, averaged=outcome, duration_s=duration_s)
        await runtime.step_done(
            step,
            loss,
            f"group {members} round {result.duration_s * 1e3:.1f} ms sent {result.bytes_sent / 1e6:.2f} MB",
            group=members,
            k=outcome.group.k,
            round_s=round(result.duration_s, 4),
            missing_parts=len(result.missing_parts),
        )

    async def _resync(self, resync: Resync) -> None:
        runtime, engine = self.runtime, self.engine
        runtime.health.resync_started(resync)
        try:
            snapshot = await engine.fetch_state(resync, runtime.model.state_tensors())
        except (PhalanxError, ValueError) as e:
            logger.warning(f"state download from {resync.donor[-8:]} failed: {e}")
            return
        await runtime.in_thread(runtime.model.load_state_tensors, snapshot.tensors)
        engine.set_state(snapshot.version, snapshot.step)
        runtime.health.resynced(snapshot.step)
        logger.info(f"loaded state of step {snapshot.step} from {resync.donor[-8:]}")
        runtime.emit("resynced", step=snapshot.step, donor=resync.donor)

    async def _recompute(self, peer_id: str) -> torch.Tensor:
        """A validator's honest recomputation of `peer_id`'s gradient at this round's parameters."""
        runtime = self.runtime

        def run() -> torch.Tensor:
            if self._validator_model is None:
                self._validator_model = copy.deepcopy(runtime.model.module)
            self._validator_model.load_state_dict(runtime.model.module.state_dict())
            return runtime.gradient(self._validator_model, peer_id, self.engine.step)[1].cpu()

        return await runtime.in_thread(run)
