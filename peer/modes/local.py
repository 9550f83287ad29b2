"""lasgd and gossip: every local step is a step of the wrapped optimizer that never waits; every
sync_every steps an exchange of the progress since the last average starts in the background and is
merged at a later step (peer/local_exchange.py). A newcomer takes the model of the peer furthest on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any, Optional

import torch

from phalanx.aggregation.compression import ErrorFeedback
from phalanx.errors import ConfigError, PhalanxError
from phalanx.peer.local_exchange import LocalExchange
from phalanx.peer.modes.base import Mode, ModeStatistics, Swarm, call_closure
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, RoundRequest

logger = logging.getLogger(__name__)


class LocalMode(Mode):
    def __init__(self, swarm: Swarm) -> None:
        super().__init__(swarm)
        self._in_flight: Optional[concurrent.futures.Future] = None  # the exchange running
        self._steps = 0  # local steps taken (the schedule follows them)
        self._since_exchange = 0
        self._lr_max = max(g.get("initial_lr", g["lr"]) for g in swarm.inner.param_groups)

    @classmethod
    def check_settings(cls, name: str, target_batch_size: Optional[int], settings: dict[str, Any]) -> None:
        """What lasgd/gossip take in phalanx join but not here: the loop computes its own gradients, so
        there is no look-ahead point to compute them at, and the wrapped optimizer's state is its own."""
        if target_batch_size is not None:
            raise ConfigError(
                f"phalanx.Optimizer(mode={name!r}, target_batch_size=...): {name} exchanges every sync_every local "
                "steps and never waits for a global batch; drop target_batch_size and set sync_every"
            )
        if settings.get("dana"):
            raise ConfigError(
                f"phalanx.Optimizer(mode={name!r}, dana=True): DANA computes gradients at a look-ahead point your "
                "loop does not know of; drop dana (or use `phalanx join --mode lasgd --dana` with a task)"
            )
        if settings.get("average_optimizer_state"):
            raise ConfigError(
                f"phalanx.Optimizer(mode={name!r}, average_optimizer_state=True): the wrapped optimizer's state "
                "stays local here; drop average_optimizer_state (or use `phalanx join --mode lasgd` with SGD)"
            )

    async def open(self) -> None:
        swarm = self.swarm
        self.exchange = LocalExchange(
            swarm.node.engine, swarm.trainable, swarm.plan.exchange, lr=self._lr_max,
            timeout_s=swarm.plan.round.allreduce_timeout_s, in_thread=swarm.in_thread,
        )  # fmt: skip

    async def joined(self) -> None:
        await self._join_late()  # like phalanx join: a newcomer starts from the swarm's model

    def step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """The wrapped optimizer steps on this batch's gradient; the exchange in flight is merged once it
        is done, and every sync_every steps a new one starts while the loop goes on."""
        loss = call_closure(closure)
        swarm, exchange = self.swarm, self.exchange
        observe = exchange.correction.gap_aware is not None
        before = swarm.trainable.flat_params() if observe else None
        swarm.inner.step()
        if before is not None:  # Gap-Aware's statistic: the unpenalized step, in units of the largest lr
            step = (before - swarm.trainable.flat_params()) / self._lr_max
            if torch.isfinite(step).all():
                exchange.correction.observe(step)
        self._steps += 1
        self._since_exchange += 1
        if self._in_flight is not None and self._in_flight.done():
            self._land()
        if self._in_flight is None and self._since_exchange >= swarm.plan.exchange.sync_every:
            swarm.check_node()
            exchange.snapshot()
            self._since_exchange = 0
            self._in_flight = swarm.submit(swarm.node.engine.run_round(RoundRequest(prepare=exchange.contribution)))
        return loss

    @property
    def position(self) -> int:
        return self._steps

    @property
    def round_in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def feedback(self) -> Optional[ErrorFeedback]:
        return self.exchange.feedback

    def statistics(self) -> ModeStatistics:
        penalties = self.exchange.state.penalties
        return ModeStatistics(
            local_samples=self._since_exchange * self.swarm.batch_size_per_step,
            samples_per_round=self.swarm.plan.exchange.sync_every * self.swarm.batch_size_per_step,
            staleness_penalty=penalties[-1].mean_divisor if penalties else None,
        )

    def state_dict(self) -> dict[str, Any]:
        """The base the next exchange measures progress from (its version is the global step)."""
        return {"local_base": self.exchange.state.base.clone(), "local_steps": self._steps}

    async def load_state(self, state: dict[str, Any], step: int) -> None:
        if "local_base" not in state:
            mode = self.swarm.plan.training.mode
            raise ConfigError(
                f"phalanx.Optimizer.load_state_dict: a {mode} checkpoint has local_base; this one has none"
            )
        self.exchange.restore(state["local_base"], step)
        self._steps = int(state.get("local_steps", 0))
        await self.exchange.publish()

    def load_state_from_peers(self) -> bool:
        return self.swarm.call(self._join_late())

    def close(self) -> None:
        if self._in_flight is not None:
            self._in_flight.cancel()

    def _land(self) -> None:
        """Merge the finished exchange (this thread holds the parameters) and publish the new base."""
        swarm, exchange, future = self.swarm, self.exchange, self._in_flight
        assert future is not None
        self._in_flight = None
        try:
            outcome = future.result()
        except ROUND_FAILURES as e:
            exchange.failed()
            swarm.round_failed()
            logger.info(f"exchange at version {exchange.version} failed: {e}; the next one starts in sync_every steps")
            return
        if not isinstance(outcome, Averaged):
            exchange.failed()
            return
        part = exchange.last
        if part is not None and part.reset_to is not None:  # too far behind: our progress is dropped
            logger.info(f"{part.penalty.gap_versions} versions behind (> max_gap): took the swarm's model")
            swarm.trainable.load_flat_params(part.reset_to)
            exchange.state.snapshot = part.reset_to.clone()
        elif part is not None and part.penalty.gap_versions > 0:
            penalty = part.penalty
            logger.info(
                f"stale contribution ({penalty.gap_versions} versions behind): "
                f"{penalty.method} divided it by {penalty.mean_divisor:.2f} on average"
            )
            swarm.metrics.staleness_penalty = penalty.mean_divisor
            swarm.hooks.event("penalty", gap=penalty.gap_versions, method=penalty.method, divisor=penalty.mean_divisor)
        exchange.merge(outcome)
        swarm.call(exchange.publish())
        swarm.landed(outcome, swarm.plan.exchange.sync_every * swarm.batch_size_per_step, self.position)

    async def _join_late(self) -> bool:
        """Download the state of the peer furthest on and take it as ours (the caller's thread waits, so
        the parameters hold still); False when no peer is past version 0."""
        swarm, exchange, node = self.swarm, self.exchange, self.swarm.node
        peers = {p: r.step for p, r in node.membership.peers().items() if p != node.peer_id}
        try:
            found = await exchange.download(peers)
        except (PhalanxError, ValueError) as e:
            logger.warning(f"could not download the swarm's model: {e}; starting fresh")
            found = None
        if found is not None:
            snapshot, donor = found
            await asyncio.get_running_loop().run_in_executor(None, exchange.adopt, snapshot)
            logger.info(f"joined a running swarm: model of version {snapshot.step} from {donor[-8:]}")
            swarm.last_round = "resynced"
            swarm.hooks.event("resynced", donor=donor)
        await exchange.publish()
        return found is not None
