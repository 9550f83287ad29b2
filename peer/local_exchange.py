"""lasgd/gossip's exchange in `phalanx.Optimizer`, under a user's loop or `phalanx join`'s (peer/trainer.py).

    snapshot s = x (training thread), then a round of the engine whose contribution is u = s − b,
    corrected for staleness once the group says who holds the freshest base (peer.local_sgd)
    merge (training thread): b' = b_ref + avg(u'), x ← b' + (x_now − s)

With --compression topk:<fraction> a peer sends the largest entries of e + u' and keeps the rest in
its residual e for later exchanges (error feedback, as DiLoCo's pseudo-gradient; docs/algorithms.md §9).

Local steps go on while the round runs; only the snapshot and the merge touch the parameters, both on
the training thread. The base is published for members behind us to fetch (and every few merges the
whole state, for newcomers).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Optional

import torch

from phalanx.aggregation.compression import ErrorFeedback
from phalanx.errors import PeerProtocolError, PhalanxError
from phalanx.peer.local_sgd import Contribution, LocalState, StalenessCorrection, merge
from phalanx.peer.model import Trainable
from phalanx.peer.plan import ExchangeConfig
from phalanx.protocol.engine import Averaged, RoundEngine
from phalanx.protocol.matchmaking import GroupSpec
from phalanx.protocol.state_sync import StateSnapshot

logger = logging.getLogger(__name__)

BASE_KEY = b"lasgd-base"  # where each peer publishes its current base (for stale members to fetch)
PUBLISH_STATE_EVERY = 5  # merges between full-state snapshots for newcomers

InThread = Callable[..., Awaitable[Any]]


class LocalExchange:
    def __init__(
        self,
        engine: RoundEngine,
        trainable: Trainable,
        exchange: ExchangeConfig,
        *,
        lr: float,
        timeout_s: float,
        in_thread: InThread,
    ) -> None:
        self.engine, self.trainable, self.exchange = engine, trainable, exchange
        engine.state.keep_serving(BASE_KEY)
        self.timeout_s, self.in_thread = timeout_s, in_thread
        self.correction = StalenessCorrection(exchange.staleness, lr)
        self.state = LocalState(base=trainable.flat_params())
        self.merges = 0
        self.last: Optional[Contribution] = None  # this peer's part of the exchange in flight
        self._base_ref: Optional[torch.Tensor] = None  # the base the exchange in flight merges onto
        fraction = exchange.topk_fraction
        self.feedback = None if fraction is None else ErrorFeedback(self.state.base.numel(), fraction)

    @property
    def version(self) -> int:
        """Averages behind this peer's base."""
        return self.state.version

    def snapshot(self) -> None:
        """s = x, the point the next exchange's contribution is measured to (training thread)."""
        self.state.snapshot = self.trainable.flat_params()

    async def contribution(self, group: GroupSpec) -> tuple[torch.Tensor, float]:
        """This peer's part once the group says who holds the freshest base: the progress since our
        base, corrected for its staleness (weight 0 when too far behind: see `Contribution.reset_to`)."""
        versions = group.versions or [self.state.version] * len(group.members)

        async def fetch(index: int) -> torch.Tensor:
            return await self.fetch_base(group.members[index], versions[index])

        part = await self.state.contribution(versions, fetch, self.correction, self.exchange.max_gap)
        self._base_ref, self.last = part.base_ref, part
        update = part.update
        if self.feedback is not None and part.weight > 0:
            update = self.feedback.send(update)
        if self.exchange.average_optimizer_state:
            momentum = await self.in_thread(self.trainable.flat_momentum)
            update = torch.cat([update, momentum if momentum is not None else torch.zeros_like(update)])
        return update, part.weight

    async def fetch_base(self, donor: str, version: int) -> torch.Tensor:
        template = {"base": self.state.base}
        snapshot = await self.engine.state.fetch(donor, BASE_KEY, template, timeout_s=self.timeout_s)
        if snapshot.step != version:
            raise PeerProtocolError(f"base of version {snapshot.step}, expected {version}", peer=donor)
        return snapshot.tensors["base"]

    def failed(self) -> None:
        """The exchange in flight delivered nothing: the next one's u covers its progress again, so what
        it took from the residual goes back (training thread)."""
        if self.feedback is not None:
            self.feedback.give_back()

    def merge(self, outcome: Averaged) -> None:
        """b' = b_ref + avg(u'); x ← b' + (x_now − s); the momentum too when it is averaged (training thread)."""
        assert self._base_ref is not None and self.state.snapshot is not None
        if self.feedback is not None:
            self.feedback.delivered()
            if self.last is not None and self.last.reset_to is not None:
                self.feedback.residual.zero_()  # progress from a base the swarm left behind, given up with it
        averaged = outcome.result.vector
        numel = self.state.base.numel()
        new_base = self._base_ref + averaged[:numel]
        self.trainable.load_flat_params(merge(new_base, self.trainable.flat_params(), self.state.snapshot))
        if self.exchange.average_optimizer_state:
            self.trainable.load_flat_momentum(averaged[numel:])
        self.state.base = new_base
        self.state.version = max(outcome.group.versions or [self.state.version]) + 1
        self.merges += 1

    async def publish(self) -> None:
        """Join with our base's version; publish the base, and every few merges the whole state."""
        self.engine.set_state(b"", self.state.version)
        await self.engine.state.publish(
            StateSnapshot(step=self.state.version, version=b"", tensors={"base": self.state.base}), BASE_KEY
        )
        if self.merges % PUBLISH_STATE_EVERY == 0:
            tensors = await self.in_thread(self.trainable.state_tensors)
            await self.engine.state.publish(StateSnapshot(step=self.state.version, version=b"", tensors=tensors))

    async def download(self, peers: dict[str, int]) -> Optional[tuple[StateSnapshot, str]]:
        """The whole state of the peer furthest on (`peers`: peer id → version), for a newcomer; None
        when every peer is at version 0 (nothing to catch up on). Loading it is the caller's."""
        if not peers or max(peers.values()) == 0:
            return None
        donor = max(peers, key=lambda p: peers[p])
        snapshot = await self.engine.state.fetch(donor, None, self.trainable.state_tensors(), timeout_s=self.timeout_s)
        return snapshot, donor

    def adopt(self, snapshot: StateSnapshot) -> None:
        """Take a downloaded state as ours: parameters, optimizer state, base and version (training thread)."""
        self.trainable.load_state_tensors(snapshot.tensors)
        self.state.base = self.trainable.flat_params()
        self.state.version = snapshot.step
        if self.feedback is not None:
            self.feedback.residual.zero_()

    def restore(self, base: torch.Tensor, version: int) -> None:
        """A checkpoint's base and version (the parameters are the caller's to load)."""
        if base.shape != self.state.base.shape:
            raise PhalanxError(f"the checkpoint's base has {base.numel()} values; the model has {self.state.base.numel()}")
        self.state.base = base.detach().to("cpu", torch.float32).clone()
        self.state.version = int(version)
