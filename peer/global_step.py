"""One global step of a lockstep swarm, in `phalanx.Optimizer` (peer/optimizer.py), under a user's loop
or `phalanx join --mode sync`'s (peer/trainer.py, over a Task).

    add(gradient, samples)            local steps add up to this peer's share of the target batch
    round()                            average the mean gradient with the swarm, weighted by
                                       samples (cancellable); a mixing group (--group-size)
                                       averages the models too
    round(models_only=True)            average the models alone: the last rounds of a swarm split
                                       into groups, which bring its members onto one model
    finish(outcome)                    apply it with the optimizer and publish state, or (behind the
                                       swarm) download a donor's state instead (never cancelled)

The weight of a contribution is its samples over (target batch + one step), so at most 1: reducers
never trust a weight above 1 (a peer could inflate its own), and the weighted mean Σ wᵢgᵢ / Σ wᵢ is
the sample-weighted one. Without a target every contribution is one step and weighs 1, as verified
rounds require of every part.

A mixing group's members bring θ/η besides their gradient (η the largest base learning rate), so that a
robust aggregator's radius means for the models what it means for the gradients (docs/algorithms.md §11).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Optional, Union

import torch

from phalanx.errors import PhalanxError
from phalanx.peer.model import Trainable
from phalanx.peer.node import Node
from phalanx.protocol.btard import Recompute
from phalanx.protocol.engine import Averaged, Resync, RoundRequest, Verification

logger = logging.getLogger(__name__)

InThread = Callable[..., Awaitable[Any]]  # (fn, *args) -> awaitable of fn(*args) on the loop's executor (off the loop)
# the next round is joined while this one runs (RoundRequest.next_follows) when the last one landed at most this
# long before this one began: the next group then waits for our part no longer than our step takes, well
# inside the members' idle limit (--part-idle-timeout-s) for a part that does not come
NEXT_FOLLOWS_S = 1.0


class GlobalStep:
    def __init__(
        self,
        node: Node,
        trainable: Trainable,
        *,
        batch_size_per_step: int,
        target_batch_size: Optional[int],
        wait_for_peers: int,
        in_thread: InThread,
        recompute: Optional[Recompute] = None,
    ) -> None:
        self.node, self.engine, self.trainable = node, node.engine, trainable
        self.batch_size_per_step, self.target_batch_size = batch_size_per_step, target_batch_size
        self.wait_for_peers, self.in_thread, self.recompute = wait_for_peers, in_thread, recompute
        self.samples = 0  # accumulated since the last global step
        self.share = self.next_share()
        self._sum: Optional[torch.Tensor] = None  # (numel,) Σ gradient × local steps, when more than one
        self._single: Optional[torch.Tensor] = None  # the one gradient of a single local step (no copy)
        self._landed_at: Optional[float] = None  # when the last round's outcome came back (monotonic)
        self._model_scale = max(trainable.base_lrs)  # η: a mixing group averages θ/η
        self.mixed = False  # the last round averaged models: the members' models differed
        self._models_only = False

    @property
    def step(self) -> int:
        """Global steps of the state this peer holds."""
        return self.engine.step

    @property
    def ready(self) -> bool:
        """This peer's share of the target batch is in: time for a round."""
        return self.samples >= self.share

    def next_share(self) -> int:
        """Samples to accumulate before a round: the target split among the trainers this peer sees
        (at least `wait_for_peers`), rounded up to whole local steps; one step without a target."""
        if self.target_batch_size is None:
            return self.batch_size_per_step
        trainers = max(len(self.node.membership.peers()), self.wait_for_peers, 1)
        return math.ceil(self.target_batch_size / trainers / self.batch_size_per_step) * self.batch_size_per_step

    def add(self, gradient: torch.Tensor) -> None:
        """Add one local step's mean gradient (numel,) over batch_size_per_step samples."""
        if self.samples == 0:
            self._single = gradient
        else:
            if self._sum is None:
                self._sum = torch.zeros_like(self._single, dtype=torch.float32)
            if self._single is not None:
                self._sum.copy_(self._single)
                self._single = None
            self._sum.add_(gradient)
        self.samples += self.batch_size_per_step

    def reset(self) -> None:
        self.samples, self._single = 0, None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a newcomer downloads: parameters and the optimizer's state (identical on every peer)."""
        return self.trainable.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.trainable.load_state_tensors(tensors)
        self.reset()

    async def attempt(self) -> Union[Averaged, Resync, None]:
        """`round` then `finish`, for callers that never cancel halfway."""
        return await self.finish(await self.round())

    async def round(self, *, models_only: bool = False) -> Union[Averaged, Resync]:
        """Average the accumulated gradient with a group (or learn that this peer is behind); may be
        cancelled. Round failures raise (ROUND_FAILURES) and keep the gradient for another try.
        `models_only`: a zero gradient, and `finish` takes the group's model without a step."""
        self._models_only = models_only
        if models_only:
            vector = torch.zeros(self.trainable.numel)
        else:
            steps = self.samples // self.batch_size_per_step
            vector = self._single if self._single is not None else self._sum / steps
        follows = self._landed_at is not None and time.monotonic() - self._landed_at <= NEXT_FOLLOWS_S
        request = RoundRequest(
            vector.to("cpu", torch.float32), 1.0 if models_only else self.weight,
            verification=Verification(recompute=self.recompute), next_follows=follows, model=self._scaled_model,
        )  # fmt: skip
        try:
            return await self.engine.run_round(request)
        finally:
            self._landed_at = time.monotonic()

    def _scaled_model(self) -> torch.Tensor:
        return self.trainable.flat_params().div_(self._model_scale)

    @property
    def weight(self) -> float:
        """This contribution's weight in the round: samples / (target + one step), 1 without a target."""
        if self.target_batch_size is None:
            return 1.0
        return self.samples / (self.target_batch_size + self.batch_size_per_step)

    def _apply(self, outcome: Averaged) -> None:
        """A mixing group's model first, then the step on the group's gradient (none after a models-only round)."""
        if outcome.model is not None:
            self.trainable.load_flat_params(outcome.model * self._model_scale)
        if not self._models_only:
            self.trainable.apply(outcome.result.vector, self.engine.step)

    async def finish(self, outcome: Union[Averaged, Resync]) -> Union[Averaged, Resync, None]:
        """Averaged: applied with the optimizer and published. Resync: the swarm's state is loaded
        instead (the accumulated gradient, of an old state, is dropped). None: the state download
        failed; try another round."""
        if isinstance(outcome, Resync):
            try:
                snapshot = await self.engine.fetch_state(outcome, self.trainable.state_tensors())
            except (PhalanxError, ValueError) as e:
                logger.warning(f"state download from {outcome.donor[-8:]} failed: {e}")
                return None
            await self.in_thread(self.trainable.load_state_tensors, snapshot.tensors)
            self.engine.set_state(snapshot.version, snapshot.step, together=outcome.together)
            logger.info(f"loaded state of step {snapshot.step} from {outcome.donor[-8:]}")
        else:
            # applying is never cancelled halfway: the model is either before or after this step
            await asyncio.shield(self.in_thread(self._apply, outcome))
            await self.engine.completed(outcome, self.trainable.state_tensors)
            self.mixed = outcome.model is not None
        self.reset()
        self.share = self.next_share()
        return outcome
