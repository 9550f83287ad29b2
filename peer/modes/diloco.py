"""diloco: `inner_steps` steps of the wrapped optimizer, then a round on the pseudo-gradient and the outer
Nesterov step (peer/outer_step.py), in the background with overlap. Verified, a phase starts from a fresh
inner state and validators replay a member's phase (peer/phase_replay.py), some of them sitting a phase
out to replay one in secret."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from phalanx.aggregation.compression import ErrorFeedback
from phalanx.errors import ConfigError
from phalanx.peer.modes.base import Interrupted, LockstepMode, ModeStatistics, Swarm, call_closure, model_index
from phalanx.peer.outer_step import OuterStep, phase_lr_scale, write_flat
from phalanx.peer.phase_replay import PhaseReplay
from phalanx.protocol.btard.validator import drawn_to_sit_out
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, Resync

logger = logging.getLogger(__name__)


class DiLoCoMode(LockstepMode):
    def __init__(self, swarm: Swarm) -> None:
        super().__init__(swarm)
        public = swarm.public if swarm.plan.round.verify is not None else None
        if public is not None:
            model_index(public.model, swarm.trainable.params)
        self._replay = (
            None
            if public is None
            else PhaseReplay(public.model, swarm.inner, public.batch_fn, public.loss_fn, public.seed)
        )
        self._in_flight: Optional[concurrent.futures.Future] = None  # the outer round running

    async def open(self) -> None:
        swarm, outer = self.swarm, self.swarm.plan.outer
        self.outer = self.steps = OuterStep(
            swarm.node, swarm.trainable.params, inner_steps=outer.inner_steps, outer_lr=outer.outer_lr,
            outer_momentum=outer.outer_momentum, in_thread=swarm.in_thread, overlap=outer.overlap == "on",
            topk_fraction=outer.topk_fraction, recompute=self._replay_phase if self._replay is not None else None,
            contribute=swarm.hooks.contribute,
        )  # fmt: skip
        self.announce(0)

    def step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """The wrapped optimizer steps on this batch's gradient, here; at a boundary, the outer round."""
        # a verified peer sitting a phase out replays another member's instead: no closure is called
        loss = call_closure(closure) if self.validating is None else None
        if self._replay is not None:
            replayed = self._verified_inner_step()
            loss = replayed if replayed is not None else loss
        else:
            self.swarm.inner.step()
        self.outer.inner_step_done()
        self._boundary()
        return loss

    @property
    def position(self) -> int:
        """Inner steps: H per outer step begun, plus those since."""
        return self.outer.position

    @property
    def validating(self) -> Optional[str]:
        """Verified: the member whose phase this peer replays instead of training its own (the previous
        round's seed drew it to sit this phase out; it picked the member in secret). `step()` then calls
        no closure and ignores the gradients: pass the loss as a closure to save computing them."""
        return self.outer.sitting

    @property
    def round_in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def settled(self) -> bool:
        return self._in_flight is None

    def shared_parameters(self) -> torch.Tensor:
        return self.outer.anchor

    @property
    def feedback(self) -> Optional[ErrorFeedback]:
        return self.outer.feedback

    def statistics(self) -> ModeStatistics:
        per_step = self.swarm.batch_size_per_step
        return ModeStatistics(
            local_samples=self.outer.inner * per_step, samples_per_round=self.outer.inner_steps * per_step
        )

    def state_dict(self) -> dict[str, Any]:
        """θ_t and v (the parameters, x, are the model's to save). A round still in flight is landed first
        (waiting for it): it writes θ, v and the global step from the swarm's thread, so a checkpoint read
        meanwhile mixed two outer steps. Landing moves the parameters in place, so a model state_dict()
        taken just before holds them too."""
        if self._in_flight is not None:
            try:
                self._land()
            except Interrupted:  # left as a failed round: its inner steps are in x, counted again
                pass
        return {
            "outer_momentum": self.outer.momentum.detach().cpu().clone(),
            "outer_anchor": self.outer.anchor.detach().cpu().clone(),
            "inner_steps_taken": self.outer.inner,  # since θ_t (x holds them)
        }

    async def load_state(self, state: dict[str, Any], step: int) -> None:
        if "outer_momentum" not in state:
            raise ConfigError(
                "phalanx.Optimizer.load_state_dict: a diloco checkpoint has outer_momentum; this one has none"
            )
        # θ_t itself when saved (the parameters hold x, which may have moved on from it)
        self.outer.restore(state["outer_momentum"], state.get("outer_anchor"), step)
        if self._replay is not None:  # a verified phase starts at θ_t: its steps are replayed from there
            write_flat(self.outer.params, self.outer.anchor)
        else:
            self.outer.inner = int(state.get("inner_steps_taken", 0))
        self.announce(step)

    def flush(self) -> None:
        """Wait for the round in flight and apply it."""
        if self._in_flight is not None:
            self._land()

    def close(self) -> None:
        if self._in_flight is not None:
            self._in_flight.cancel()

    # ---- the boundary ----------------------------------------------------------------------------

    def _boundary(self) -> None:
        """Land the round in flight once it is over (a boundary waits for it), then begin the next one at
        a boundary; without overlap, wait for that one too. Failed rounds are retried after a back-off,
        their inner steps counted into the next Δ."""
        outer, swarm = self.outer, self.swarm
        if self._in_flight is not None and (self._in_flight.done() or outer.inner >= outer.inner_steps):
            self._land()
        while outer.inner >= outer.inner_steps and self._in_flight is None:
            if not outer.ready and swarm.interrupted.wait(outer.retry_in_s):  # a back-off after a failed round
                raise Interrupted("interrupted during the back-off after a failed outer round")
            swarm.check_node()
            delta = outer.begin()
            self._in_flight = swarm.submit(self._round(delta))
            if outer.overlap:
                return
            self._land()

    def _land(self) -> None:
        """Apply the round in flight (waiting for it). One an interrupt left counts as failed (its inner
        steps go into the next Δ), and Interrupted raises."""
        outer, swarm, future = self.outer, self.swarm, self._in_flight
        assert future is not None
        self._in_flight = None
        try:
            outcome = future.result()
        except Interrupted:
            outer.failed()
            raise
        except ROUND_FAILURES as e:
            outer.failed()
            swarm.round_failed()
            logger.warning(f"outer round at global step {outer.step} failed: {e}; retrying")
            return
        if outcome is None:  # the state download failed: another round
            outer.failed()
            return
        outer.rebase()
        swarm.landed(outcome, outer.inner_steps * swarm.batch_size_per_step, self.position)
        if isinstance(outcome, Averaged):
            group, round_s = len(outcome.group.members), swarm.node.snapshot().last_round_s
            logger.info(f"outer step {outer.step}: group {group}")
            swarm.hooks.event("outer", outer_step=outer.step, group=group, round_s=round(round_s, 4))
        self._sit_out_next_phase(outcome)

    async def _round(self, delta: torch.Tensor) -> Union[Averaged, Resync, None]:
        outcome = await self.swarm.unless_interrupted(self.outer.round(delta))
        return await asyncio.shield(self.outer.finish(outcome))  # θ and v change all at once or not at all

    # ---- verified phases -------------------------------------------------------------------------

    def _verified_inner_step(self) -> Optional[torch.Tensor]:
        """A phase starts from a fresh inner state, its first steps at a learning rate ramping up over
        phase_warmup steps (what the schedule gives, scaled for this step only), and each step's
        hyperparameters are recorded for validators' replays of other members' phases. A peer sitting
        the phase out takes the replay's step instead (its parameters stay at θ_t) and returns its loss."""
        outer, replay, inner = self.outer, self._replay, self.swarm.inner
        assert replay is not None
        if outer.inner == 0:
            replay.phase_starts()
        scale = phase_lr_scale(outer.inner, self.swarm.plan.outer.phase_warmup)
        scheduled = [g["lr"] for g in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = group["lr"] * scale
        try:
            replay.record(outer.position)
            if outer.sitting is None:
                inner.step()
                return None
            loss = replay.step(outer.position)
            if outer.inner + 1 >= outer.inner_steps:
                replay.finish()
            return loss
        finally:
            for group, lr in zip(inner.param_groups, scheduled, strict=True):
                group["lr"] = lr

    def _sit_out_next_phase(self, outcome: Union[Averaged, Resync]) -> None:
        """After a round landed: when its seed draws this peer as a validator, the next phase replays a
        member picked in secret (the member must not know it is checked while it trains)."""
        outer, replay, verify = self.outer, self._replay, self.swarm.plan.round.verify
        if replay is None or verify is None or not verify.validators_sit_out:
            return
        outer.sitting = None
        replay.abandon()
        verdict = outcome.verdict if isinstance(outcome, Averaged) else None
        if verdict is None or not verdict.seed:
            return
        node = self.swarm.node
        drawn = drawn_to_sit_out(verdict.seed, list(verdict.committed), verify.validators)
        # not another drawn validator: it sits the phase out too
        others = [p for p in verdict.committed if p not in drawn and p not in node.membership.banned]
        if node.peer_id not in drawn or not others:
            return
        outer.sitting = secrets.SystemRandom().choice(others)
        replay.begin(outer.sitting, outer.step * outer.inner_steps, outer.anchor, outer.params)
        logger.info(f"outer step {outer.step}: sitting this phase out to replay {outer.sitting[-8:]}'s")

    async def _replay_phase(self, peer_id: str) -> torch.Tensor:
        """A validator's replay of `peer_id`'s inner steps of this round's phase, from θ_t (the caller's
        thread waits for the round: strict diloco, so the model holds still)."""
        outer, replay = self.outer, self._replay
        assert replay is not None
        first = outer.step * outer.inner_steps
        if replay.ready is not None and replay.ready[:2] == (peer_id, first):  # replayed while sitting out
            return replay.ready[2].clone()
        return await self.swarm.in_thread(replay.delta, peer_id, first, outer.inner_steps, outer.anchor, outer.params)
