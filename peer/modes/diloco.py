"""`--mode diloco`: --inner-steps local steps with the task's optimizer, then an outer Nesterov step
on the swarm's averaged pseudo-gradient (peer/outer_step.py, shared with `phalanx.Optimizer`).

    H × (gradient on (seed, peer, step)'s batch, inner optimizer step)   (worker thread)
    round: all-reduce θ_t − x                                            (event loop; with --overlap on,
                                                                           while the next inner steps run)
    outer step: v ← μ·v + Δ̄, θ ← θ_t − η·(Δ̄ + μ·v); x moved onto θ     (never cancelled halfway)

The step count (reports, --steps, the eval and checkpoint cadence, the batches) counts inner steps.
--eval-every evaluates θ_t, the swarm's model (the same on every peer), not the peer's own inner
iterate. The last boundary before --steps runs strictly, so a peer stops on θ of its last outer step
(evaluated once more if it landed after that step's evaluation).

An attacker (--attack) takes honest inner steps (label_flip: on flipped labels) and attacks the
pseudo-gradient it sends: ALIE's and the others' statistics are those of honest Δs it recomputes
from θ_t on other batches of its own.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Optional, Union

import torch

from phalanx.peer.outer_step import OuterStep, write_flat
from phalanx.peer.runtime import Runtime
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, Resync

logger = logging.getLogger(__name__)


class DilocoMode:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.engine = runtime, runtime.engine
        outer = runtime.plan.outer
        attack = runtime.attack
        self.outer = OuterStep(
            runtime.node, runtime.model.params, inner_steps=outer.inner_steps, outer_lr=outer.outer_lr,
            outer_momentum=outer.outer_momentum, in_thread=runtime.in_thread, overlap=outer.overlap == "on",
            contribute=self._attacked if attack is not None and not attack.flips_labels else None,
        )  # fmt: skip
        self._pending: Optional[asyncio.Task] = None  # the round in flight (round, then finish)
        self._theta_module: Optional[torch.nn.Module] = None
        self._evaluated_at = -1  # the outer step of the last evaluation
        runtime.evaluated_module = self._theta  # the swarm's model θ_t, the same on every peer

    @property
    def step(self) -> int:
        """Inner steps taken: H per outer step begun, plus those since."""
        return self.outer.position

    async def run(self) -> None:
        runtime, outer = self.runtime, self.outer
        try:
            while await runtime.check_node():  # a stop is checked between inner steps
                if self._pending is not None and self._pending.done():
                    await self._land()
                if not outer.ready:
                    if outer.inner >= outer.inner_steps:  # a boundary waits for the round in flight, or a back-off
                        if not await self._wait():
                            break
                        continue
                    if runtime.done(self.step):  # after the round in flight, if any
                        if self._pending is None or not await self._wait():
                            break
                        continue
                    await self._inner_step()
                    continue
                delta = await runtime.in_thread(outer.begin)
                self._pending = asyncio.ensure_future(self._round(delta))
                if not outer.overlap or runtime.done(self.step):  # strict, or the last boundary: wait for it
                    if not await self._wait():
                        break
            if self._evaluated_at != outer.step and self.step % runtime.config.eval_every == 0:
                await runtime.evaluate(self.step)  # the last outer step landed after this step's evaluation
        finally:
            if self._pending is not None:
                self._pending.cancel()
                await asyncio.gather(self._pending, return_exceptions=True)

    async def _inner_step(self) -> None:
        runtime, outer = self.runtime, self.outer
        step = self.step
        attack = runtime.attack
        flip = attack is not None and attack.flips_labels
        loss, grad = await runtime.in_thread(
            lambda: runtime.gradient(runtime.model.module, runtime.node.peer_id, step, flip_labels=flip)
        )
        await runtime.in_thread(runtime.model.apply, grad, step)
        outer.inner_step_done()
        await runtime.step_done(
            self.step, loss, f"inner {outer.inner}/{outer.inner_steps}", group=runtime.report.group_size
        )

    async def _round(self, delta: torch.Tensor) -> Union[Averaged, Resync, None]:
        outcome = await self.outer.round(delta)
        return await asyncio.shield(self.outer.finish(outcome))  # θ and v change all at once or not at all

    async def _wait(self) -> bool:
        """Wait for the round in flight (or the back-off after a failed one); False when a stop came first."""
        if self._pending is None:
            await self.runtime.sleep_or_stop(0.05)
            return not self.runtime.stop_requested.is_set()
        if await self.runtime.run_unless_stopped(asyncio.shield(self._pending)) is None:
            return False
        await self._land()
        return True

    async def _land(self) -> None:
        """The round in flight is over: rebase onto its outcome and report it, or count its failure."""
        runtime, outer = self.runtime, self.outer
        task, self._pending = self._pending, None
        assert task is not None
        try:
            outcome = task.result()
        except ROUND_FAILURES as e:
            wait = outer.failed()
            runtime.round_failed(e, f"outer step {outer.step + 1}", level=logging.WARNING)
            logger.debug(f"next outer round in {wait:.1f} s")
            return
        if outcome is None:  # the state download failed: another round
            outer.failed()
            return
        await runtime.in_thread(outer.rebase)
        if isinstance(outcome, Resync):
            runtime.health.resync_started(outcome)
            runtime.health.resynced(self.step)
            runtime.emit("resynced", step=self.step, donor=outcome.donor)
            return
        members = len(outcome.group.members)
        runtime.report.group_size = members
        runtime.health.round_done(
            step=self.step, loss=runtime.report.loss or float("nan"), samples=runtime.batch_size * outer.inner_steps,
            averaged=outcome, duration_s=self.engine.stats.last_round_s,
        )  # fmt: skip
        runtime.emit("outer", step=self.step, outer_step=outer.step, group=members, round_s=round(outcome.result.duration_s, 4))
        logger.info(f"outer step {outer.step}: group {members}, sent {outcome.result.bytes_sent / 1e6:.2f} MB")

    def _theta(self) -> torch.nn.Module:
        """The model at θ_t (worker thread): a copy of the module, with its buffers as they are now."""
        module = self.runtime.model.module
        if self._theta_module is None:
            self._theta_module = copy.deepcopy(module)
        self._theta_module.load_state_dict(module.state_dict())
        write_flat([p for p in self._theta_module.parameters() if p.requires_grad], self.outer.anchor)
        self._evaluated_at = self.outer.step
        return self._theta_module

    def _attacked(self, outer_step: int, delta: torch.Tensor) -> torch.Tensor:
        """The attack's version of this peer's pseudo-gradient (training thread)."""
        runtime = self.runtime
        assert runtime.attack is not None
        return runtime.attack.contribution(outer_step, delta, lambda k: self._honest_delta(f"extra{k}"))

    def _honest_delta(self, tag: str) -> torch.Tensor:
        """H honest inner steps from θ_t on this peer's batches tagged `tag`, on a copy of the model
        (an attacker's estimate of what honest peers send)."""
        runtime, outer = self.runtime, self.outer
        replica = copy.deepcopy(runtime.model)
        write_flat(replica.params, outer.anchor)
        first = outer.step * outer.inner_steps
        for step in range(first, first + outer.inner_steps):
            _, grad = runtime.gradient(replica.module, f"{runtime.node.peer_id}/{tag}", step)
            replica.apply(grad, step)
        return outer.anchor - torch.cat([p.detach().reshape(-1).to(torch.float32) for p in replica.params])
