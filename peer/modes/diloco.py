"""`--mode diloco`: --inner-steps local steps with the task's optimizer, then an outer Nesterov step
on the swarm's averaged pseudo-gradient (peer/outer_step.py, shared with `phalanx.Optimizer`).

    H × (gradient on (seed, peer, step)'s batch, inner optimizer step)   (worker thread)
    round: all-reduce θ_t − θ_i                                          (event loop)
    outer step: v ← μ·v + Δ̄, θ ← θ_t − η·(Δ̄ + μ·v)                      (worker thread, never cancelled)

The step count (reports, --steps, the eval and checkpoint cadence, the batches) counts inner steps.
"""

from __future__ import annotations

import logging

from phalanx.peer.outer_step import OuterStep
from phalanx.peer.runtime import Runtime
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, Resync

logger = logging.getLogger(__name__)


class DilocoMode:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.engine = runtime, runtime.engine
        outer = runtime.plan.outer
        self.outer = OuterStep(
            runtime.node, runtime.model.params, inner_steps=outer.inner_steps, outer_lr=outer.outer_lr,
            outer_momentum=outer.outer_momentum, in_thread=runtime.in_thread,
        )  # fmt: skip

    @property
    def step(self) -> int:
        """Inner steps of the state this peer holds: H per outer step, plus those since."""
        return self.outer.step * self.outer.inner_steps + self.outer.inner

    async def run(self) -> None:
        runtime, outer = self.runtime, self.outer
        model, failures = runtime.model, 0
        while (
            await runtime.check_node()
        ):  # a stop condition is checked between inner steps, never before a due outer step
            if not outer.ready:
                if runtime.done(self.step):
                    break
                step = self.step
                loss, grad = await runtime.in_thread(runtime.contribution, step)
                await runtime.in_thread(model.apply, grad, step)
                outer.inner_step_done()
                await runtime.step_done(
                    self.step, loss, f"inner {outer.inner}/{outer.inner_steps}", group=runtime.report.group_size
                )
                continue
            round_task = await runtime.run_unless_stopped(outer.round())
            if round_task is None:
                break
            try:
                outcome = await outer.finish(round_task.result())
            except ROUND_FAILURES as e:
                runtime.round_failed(e, f"outer step {outer.step}", level=logging.WARNING)
                failures += 1
                await runtime.sleep_or_stop(min(5.0, 0.1 * 2 ** min(failures, 6)))
                continue
            failures = 0
            if isinstance(outcome, Resync):
                runtime.health.resync_started(outcome)
                runtime.health.resynced(self.step)
                runtime.emit("resynced", step=self.step, donor=outcome.donor)
            elif isinstance(outcome, Averaged):
                members = len(outcome.group.members)
                runtime.report.group_size = members
                runtime.health.round_done(
                    step=self.step, loss=runtime.report.loss or float("nan"), samples=runtime.batch_size * outer.inner_steps,
                    averaged=outcome, duration_s=self.engine.stats.last_round_s,
                )  # fmt: skip
                runtime.emit(
                    "outer",
                    step=self.step,
                    outer_step=outer.step,
                    group=members,
                    round_s=round(outcome.result.duration_s, 4),
                )
                logger.info(f"outer step {outer.step}: group {members}, sent {outcome.result.bytes_sent / 1e6:.2f} MB")
