"""`--mode lasgd` and `--mode gossip`: local steps that never wait for the network.

    local step (gradient, optional DANA look-ahead, optimizer step)      worker thread
    every H steps, if no exchange is in flight: snapshot, start one      background task
    when the exchange is done: b' = b_ref + avg(u'), x ← b' + (x − s)     worker thread

The exchange (peer.local_sgd) is an ordinary round of the engine whose contribution is the
progress since the base, corrected for staleness once the group tells who holds the freshest base.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import torch

from phalanx.aggregation.errors import PhalanxError
from phalanx.peer.local_exchange import LocalExchange
from phalanx.peer.local_sgd import look_ahead
from phalanx.peer.runtime import Runtime
from phalanx.protocol.engine import ROUND_FAILURES, Averaged
from phalanx.protocol.matchmaking import GroupSpec

logger = logging.getLogger(__name__)


class LocalMode:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.node, self.engine = runtime, runtime.node, runtime.engine
        self.config, self.exchange, self.model = runtime.config, runtime.plan.exchange, runtime.model
        self.lr = self.model.optimizer.param_groups[0]["lr"]
        self.momentum = self.model.optimizer.param_groups[0].get("momentum", 0.0)
        self.local = LocalExchange(
            self.engine, self.model, self.exchange, lr=self.lr, timeout_s=runtime.plan.round.allreduce_timeout_s,
            in_thread=runtime.in_thread,
        )  # fmt: skip
        self.correction = self.local.correction
        self.slowdown = runtime.plan.slowdown
        self._slow_rng = self.slowdown.sampler(self.config.seed, self.node.peer_id) if self.slowdown else None
        self.local_step = 0
        self._steps_at_merge = 0
        self.last_loss: Optional[float] = None

    @property
    def step(self) -> int:
        return self.local_step

    # ---- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        runtime, engine = self.runtime, self.engine
        if await runtime.run_unless_stopped(self._join_late()) is None:
            return
        await self.local.publish()
        exchange: Optional[asyncio.Task] = None
        since_exchange = 0
        try:
            while not runtime.done(self.local_step) and await runtime.check_node():
                loss = await runtime.in_thread(self._step, self.local_step)
                self.last_loss = loss
                self.local_step += 1
                since_exchange += 1
                if self.slowdown is not None:
                    await runtime.sleep_or_stop(self.slowdown.draw(self._slow_rng))
                if exchange is None and since_exchange >= self.exchange.sync_every:
                    await runtime.in_thread(self.local.snapshot)
                    exchange = asyncio.create_task(engine.run_round(prepare=self._prepare))
                    since_exchange = 0
                if exchange is not None and exchange.done():
                    await self._finish(exchange)
                    exchange = None
                await runtime.step_done(
                    self.local_step, loss, f"(version {engine.step})", group=engine.stats.last_group_size
                )
        finally:
            if exchange is not None:
                exchange.cancel()
                await asyncio.gather(exchange, return_exceptions=True)

    def _step(self, step: int) -> float:
        """One local step (worker thread): gradient (at the look-ahead with --dana), optimizer step,
        Gap-Aware's statistic."""
        model = self.model
        if self.exchange.dana:
            buffers = [model.optimizer.state[p].get("momentum_buffer") for p in model.params]
            with look_ahead(model.params, buffers, self.lr, self.momentum):
                loss, grad = self.runtime.contribution(step)
        else:
            loss, grad = self.runtime.contribution(step)
        model.apply(grad, step)
        momentum = model.flat_momentum()
        unpenalized = momentum if momentum is not None else grad.detach().cpu()
        if torch.isfinite(unpenalized).all():
            self.correction.observe(unpenalized)
        return loss

    # ---- the exchange ------------------------------------------------------------------------

    async def _prepare(self, group: GroupSpec):
        """Our contribution, once the group says who holds the freshest base."""
        runtime = self.runtime
        update, weight = await self.local.contribution(group)
        part = self.local.last
        assert part is not None
        if part.reset_to is not None:
            logger.info(f"{part.penalty.gap_versions} versions behind (> --max-gap): taking the current model")
            await runtime.in_thread(self.model.load_flat_params, part.reset_to)
            self.local.state.snapshot = part.reset_to.clone()
        elif part.penalty.gap_versions > 0:
            logger.info(
                f"stale contribution ({part.penalty.gap_versions} versions behind): "
                f"{part.penalty.method} divided it by {part.penalty.mean_divisor:.2f} on average"
            )
        penalty = part.penalty
        if penalty.gap_versions > 0:
            runtime.health.staleness_penalty = penalty.mean_divisor
            runtime.emit("penalty", gap=penalty.gap_versions, method=penalty.method, divisor=penalty.mean_divisor)
        return update, weight

    async def _join_late(self) -> None:
        """A newcomer to a running swarm starts from a member's current model instead of from scratch."""
        peers = {p: r.step for p, r in self.node.membership.peers().items() if p != self.node.peer_id}
        try:
            found = await self.local.download(peers)
        except (PhalanxError, ValueError) as e:
            logger.warning(f"could not download the swarm's model: {e}; starting fresh")
            return
        if found is None:
            return
        snapshot, donor = found
        await self.runtime.in_thread(self.local.adopt, snapshot)
        self.runtime.emit("resynced", step=self.local_step, version=snapshot.step, donor=donor)
        logger.info(f"joined a running swarm: model of version {snapshot.step} from {donor[-8:]}")

    async def _finish(self, exchange: asyncio.Task) -> None:
        runtime, engine = self.runtime, self.engine
        try:
            outcome = exchange.result()
        except ROUND_FAILURES as e:
            runtime.round_failed(e, "exchange")
            return
        if not isinstance(outcome, Averaged):
            return
        started = time.monotonic()
        await runtime.in_thread(self.local.merge, outcome)
        await self.local.publish()
        steps = self.local_step - self._steps_at_merge
        self._steps_at_merge = self.local_step
        runtime.health.round_done(
            step=self.local_step, loss=self.last_loss or 0.0, samples=steps * runtime.batch_size,
            averaged=outcome, duration_s=engine.stats.last_round_s,
        )  # fmt: skip
        runtime.report.group_size = len(outcome.group.members)
        logger.debug(f"merged version {self.local.version} in {time.monotonic() - started:.3f} s")
