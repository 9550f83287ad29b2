"""sync: every local step adds its gradient to a sum; once this peer's share of the target batch is in,
the step waits for a round that averages it with the swarm's and steps on the result
(peer/global_step.py). Verified, validators recompute a member's gradient from its public batch. With
--group-size, a swarm larger than G splits into random groups that average their models too, and
`converge()` ends the run on one model."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from phalanx.peer.global_step import GlobalStep
from phalanx.peer.modes.base import LockstepMode, ModeStatistics, Swarm, call_closure, model_index
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, Resync
from phalanx.protocol.groups import rounds_to_agree

logger = logging.getLogger(__name__)


class SyncMode(LockstepMode):
    def __init__(self, swarm: Swarm) -> None:
        super().__init__(swarm)
        public = swarm.public if swarm.plan.round.verify is not None else None
        self._verified = public
        self._index = model_index(public.model, swarm.trainable.params) if public is not None else {}
        self._validator_model: Optional[torch.nn.Module] = None

    async def open(self) -> None:
        swarm = self.swarm
        self.steps = GlobalStep(
            swarm.node, swarm.trainable, batch_size_per_step=swarm.batch_size_per_step,
            target_batch_size=swarm.target_batch_size, wait_for_peers=swarm.plan.training.wait_for_peers,
            in_thread=swarm.in_thread, recompute=self._recompute if self._verified is not None else None,
        )  # fmt: skip
        self.announce(0)

    async def joined(self) -> None:
        self.steps.share = self.steps.next_share()  # now that the trainers are in view

    def step(self, closure: Optional[Callable[[], Any]]) -> Any:
        loss = call_closure(closure)
        params = self.swarm.trainable.params
        self.steps.add(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]))
        if self.steps.ready:  # average this peer's gradient with the swarm's (weighted by samples), step on it
            samples = self.steps.samples  # counted before the round: finishing it resets the count to 0
            self.swarm.landed(self.swarm.call(self._round()), samples, self.position)
        return loss

    @property
    def position(self) -> int:
        return self.swarm.node.engine.step

    def statistics(self) -> ModeStatistics:
        return ModeStatistics(local_samples=self.steps.samples, samples_per_round=self.steps.share)

    async def load_state(self, state: dict[str, Any], step: int) -> None:
        self.announce(step)

    def converge(self) -> int:
        """End a run whose swarm was split into groups (--group-size): rounds that average the models alone
        (no gradient, no step), enough to shrink the peers' spread a millionfold in mean square
        (docs/algorithms.md §11). Every peer calls it after the same step; returns the rounds run (0: the
        swarm fits one group and its last round did not mix: its members hold one model already)."""
        size, peers = self.swarm.plan.round.matchmaking.group_size, len(self.swarm.node.membership.peers())
        if size is None or not (self.steps.mixed or peers > size):
            return 0
        rounds = rounds_to_agree(max(peers, 1), size)
        for done in range(rounds):
            try:  # one try each: after a stop, the peers that are gone do not come back
                outcome = self.swarm.call(self._round(models_only=True, retry=False))
            except ROUND_FAILURES as e:
                logger.warning(f"the rounds that bring the swarm onto one model stopped after {done}: {e}")
                return done
            self.swarm.landed(outcome, 0, self.position)
        logger.info(f"averaged the models alone for {rounds} round(s): the swarm ends on one model")
        return rounds

    async def _round(self, *, models_only: bool = False, retry: bool = True) -> Union[Averaged, Resync]:
        """The round of this global step, retried (backing off) until one completes (without `retry`, a
        failure raises)."""
        swarm, failures = self.swarm, 0
        while True:
            swarm.check_node()
            try:
                outcome = await swarm.unless_interrupted(self.steps.round(models_only=models_only))
                outcome = await asyncio.shield(self.steps.finish(outcome))  # never cancelled halfway
            except ROUND_FAILURES as e:
                failures += 1
                swarm.round_failed()
                if not retry:
                    raise
                logger.warning(f"round at global step {self.position} failed: {e}; retrying")
                await swarm.unless_interrupted(asyncio.sleep(min(5.0, 0.1 * 2 ** min(failures, 6))))
                continue
            if outcome is not None:
                return outcome

    async def _recompute(self, peer_id: str) -> torch.Tensor:
        """A validator's honest recomputation of `peer_id`'s gradient at this round's parameters, on a
        copy of the model (the caller's thread waits for the round, so the model holds still)."""
        public = self._verified
        assert public is not None
        step = self.position

        def run() -> torch.Tensor:
            if self._validator_model is None:
                self._validator_model = copy.deepcopy(public.model)
            self._validator_model.load_state_dict(public.model.state_dict())
            self._validator_model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                public.loss_fn(self._validator_model, public.batch_fn(public.seed, peer_id, step)).backward()
            copies = list(self._validator_model.parameters())
            params = [copies[self._index[id(p)]] for p in self.swarm.trainable.params]  # the optimizer's order
            return torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            ).cpu()

        return await self.swarm.in_thread(run)
