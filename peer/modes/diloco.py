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

With --verify (and --overlap off), every phase starts from a fresh inner optimizer state, so a peer's
Δ follows from θ_t and its public batches (seed, peer, step) alone, and a validator replays a
member's H inner steps to check it (H steps of compute per validation). The fresh state's first
steps run at a learning rate ramping up over --phase-warmup steps.

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

from phalanx.peer.model import Model, zero_optimizer_state
from phalanx.peer.outer_step import OuterStep, phase_lr_scale, write_flat
from phalanx.peer.runtime import Runtime
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, Resync, initial_version


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
            recompute=self._recompute if runtime.plan.round.verify is not None else None,
            topk_fraction=outer.topk_fraction,
        )  # fmt: skip
        # verified runs: Δ must follow from θ_t and public batches alone, so each phase's inner steps
        # start from a fresh inner optimizer state (its moments are not carried across outer steps)
        self.verified = runtime.plan.round.verify is not None
        self._replica: Optional[Model] = None  # a copy of the model for replays (validators, attackers)
        self._pending: Optional[asyncio.Task] = None  # the round in flight (round, then finish)
        self._theta_module: Optional[torch.nn.Module] = None
        self._evaluated_at = -1  # the outer step of the last evaluation
        runtime.evaluated_module = self._theta  # the swarm's model θ_t, the same on every peer
        runtime.checkpoint_extra = self._checkpoint_state
        if runtime.resumed is not None:
            self._resume(runtime.resumed.extra, runtime.resumed.step)

    @property
    def step(self) -> int:
        """Inner steps taken: H per outer step begun, plus those since."""
        return self.outer.position

    async def run(self) -> None:
        runtime, outer = self.runtime, self.outer
        if self.verified:
            await runtime.in_thread(zero_optimizer_state, runtime.model.optimizer)
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
        await runtime.in_thread(runtime.model.apply, grad, step, self._lr_scale(outer.inner))
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
            wait = await runtime.in_thread(outer.failed)
            runtime.round_failed(e, f"outer step {outer.step + 1}", level=logging.WARNING)
            logger.debug(f"next outer round in {wait:.1f} s")
            return
        if outcome is None:  # the state download failed: another round
            await runtime.in_thread(outer.failed)
            return
        await runtime.in_thread(outer.rebase)
        if self.verified:  # a new phase from θ_{t+1}
            await runtime.in_thread(zero_optimizer_state, runtime.model.optimizer)
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

    def _lr_scale(self, inner: int) -> float:
        """Verified runs: the phase's fresh inner state takes its first steps at a learning rate ramping
        up over --phase-warmup steps (a function of the public step number, so replays follow it)."""
        return phase_lr_scale(inner, self.runtime.plan.outer.phase_warmup) if self.verified else 1.0

    def _checkpoint_state(self) -> dict:
        """θ_t, v and the outer step (training thread); the model in the checkpoint is this peer's x."""
        outer = self.outer
        return {"diloco": {"outer_step": outer.step, "anchor": outer.anchor.cpu().clone(), "momentum": outer.momentum.cpu().clone()}}

    def _resume(self, extra: dict, step: int) -> None:
        """Back to θ_t and v of the checkpoint, with x (the model as loaded) `step − H·t` inner steps on."""
        state = extra.get("diloco")
        if not isinstance(state, dict):
            logger.info("the checkpoint holds no outer state: θ_t starts from its parameters")
            return
        outer, t = self.outer, int(state["outer_step"])
        outer.restore(state["momentum"], state["anchor"], t)
        outer.inner = max(0, step - t * outer.inner_steps)
        if self.verified and outer.inner:  # a verified phase starts at θ_t from a fresh inner state
            write_flat(outer.params, outer.anchor)
            outer.inner = 0
        self.engine.set_state(initial_version(self.runtime.plan.run_hash, outer.state_tensors(), t), t)
        logger.info(f"resumed the outer state of step {t}, {outer.inner} inner steps on")

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
        peer_id = runtime.node.peer_id
        return runtime.attack.contribution(outer_step, delta, lambda k: self._replay(f"{peer_id}/extra{k}"))

    async def _recompute(self, peer_id: str) -> torch.Tensor:
        """A validator's replay of `peer_id`'s H inner steps of this round (verified runs)."""
        return await self.runtime.in_thread(self._replay, peer_id)

    def _replay(self, batch_key: str) -> torch.Tensor:
        """Δ of H inner steps from θ_t on `batch_key`'s batches, on a copy of the model (training thread):
        from a fresh inner state in verified runs, where every peer's phase starts so; otherwise from this
        peer's own (an attacker's estimate of what honest peers send)."""
        runtime, outer = self.runtime, self.outer
        model = runtime.model
        if self._replica is None:
            self._replica = copy.deepcopy(model, {id(model.task): model.task})  # the task's data stay shared
        replica = self._replica
        write_flat(replica.params, outer.anchor)
        if self.verified:
            zero_optimizer_state(replica.optimizer)
        else:
            # a copy: load_state_dict keeps tensors that need no cast, which would share our own state
            replica.optimizer.load_state_dict(copy.deepcopy(model.optimizer.state_dict()))
        first = outer.step * outer.inner_steps
        for step in range(first, first + outer.inner_steps):
            _, grad = runtime.gradient(replica.module, batch_key, step)
            replica.apply(grad, step, self._lr_scale(step - first))
        return outer.anchor - torch.cat([p.detach().reshape(-1).to(torch.float32) for p in replica.params])
