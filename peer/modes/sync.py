"""`--mode sync`: one all-reduced gradient per step, as `phalanx.Optimizer` runs it (peer/global_step.py).

    compute gradient on (seed, peer, step)'s batch   (worker thread)
    round: matchmaking + butterfly all-reduce        (event loop)
    apply the aggregate with the optimizer            (worker thread, never cancelled)

A peer that the leader finds out of sync downloads a donor's state instead of applying.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch

from phalanx.peer.global_step import GlobalStep
from phalanx.peer.runtime import Runtime
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, Resync

logger = logging.getLogger(__name__)


class SyncMode:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.engine = runtime, runtime.engine
        self.global_step = GlobalStep(
            runtime.node, runtime.model, batch_size_per_step=runtime.batch_size, target_batch_size=None,
            wait_for_peers=runtime.config.wait_for_peers, in_thread=runtime.in_thread, recompute=self._recompute,
        )  # fmt: skip
        self._validator_model: Optional[torch.nn.Module] = None  # a copy: recomputation must not touch BatchNorm stats

    @property
    def step(self) -> int:
        return self.engine.step  # every step is a round: the engine's count is ours

    async def run(self) -> None:
        runtime, engine, global_step = self.runtime, self.engine, self.global_step
        failures = 0
        while not runtime.done(engine.step) and await runtime.check_node():
            step = engine.step
            loss, grad = await runtime.in_thread(runtime.contribution, step)
            global_step.reset()
            global_step.add(grad)
            round_task = await runtime.run_unless_stopped(global_step.round())
            if round_task is None:
                break
            try:
                outcome = await global_step.finish(round_task.result())
            except ROUND_FAILURES as e:
                runtime.round_failed(e, f"round at step {step}", level=logging.WARNING)
                failures += 1
                # back off, so a peer the swarm refuses does not spin: 0.1 s, doubling up to 5 s
                await runtime.sleep_or_stop(min(5.0, 0.1 * 2 ** min(failures, 6)))
                continue
            failures = 0
            if isinstance(outcome, Resync):
                runtime.health.resync_started(outcome)
                runtime.health.resynced(engine.step)
                runtime.emit("resynced", step=engine.step, donor=outcome.donor)
            elif isinstance(outcome, Averaged):
                await self._step_done(loss, outcome)

    async def _step_done(self, loss: float, outcome: Averaged) -> None:
        runtime, result, members = self.runtime, outcome.result, len(outcome.group.members)
        step = self.engine.step
        runtime.report.group_size = members
        duration_s = self.engine.stats.last_round_s
        runtime.health.round_done(
            step=step, loss=loss, samples=runtime.batch_size, averaged=outcome, duration_s=duration_s
        )
        await runtime.step_done(
            step,
            loss,
            f"group {members} round {result.duration_s * 1e3:.1f} ms sent {result.bytes_sent / 1e6:.2f} MB",
            group=members,
            k=outcome.group.k,
            round_s=round(result.duration_s, 4),
            missing_parts=len(result.missing_parts),
        )

    async def _recompute(self, peer_id: str) -> torch.Tensor:
        """A validator's honest recomputation of `peer_id`'s gradient at this round's parameters."""
        runtime = self.runtime

        def run() -> torch.Tensor:
            if self._validator_model is None:
                self._validator_model = copy.deepcopy(runtime.model.module)
            self._validator_model.load_state_dict(runtime.model.module.state_dict())
            return runtime.gradient(self._validator_model, peer_id, self.engine.step)[1].cpu()

        return await runtime.in_thread(run)
