"""The training loop of the asynchronous modes (`--mode lasgd` and `--mode gossip`).

    local step (gradient, optional DANA look-ahead, optimizer step)      worker thread
    every H steps, if no exchange is in flight: snapshot, start one      background task
    when the exchange is done: b' = b_ref + avg(u'), x ← b' + (x − s)     worker thread

Local steps never wait for the network. The exchange (peer.local_sgd) is an ordinary
round of the engine whose contribution is the progress since the base, corrected for
staleness once the group tells who holds the freshest base.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Optional

import torch

from phalanx.aggregation.errors import PeerProtocolError, PhalanxError, RoundAbortedError, RoundTimeoutError
from phalanx.peer.local_sgd import LocalState, StalenessCorrection, look_ahead, merge
from phalanx.protocol.engine import Averaged
from phalanx.protocol.matchmaking import GroupSpec
from phalanx.protocol.state_sync import StateSnapshot

if TYPE_CHECKING:
    from phalanx.peer.node import Node
    from phalanx.peer.trainer import Trainer

logger = logging.getLogger(__name__)

BASE_KEY = b"lasgd-base"  # where each peer publishes its current base (for stale members to fetch)
PUBLISH_STATE_EVERY = 5  # merges between full-state snapshots for newcomers


class LocalLoop:
    def __init__(self, trainer: "Trainer", node: "Node") -> None:
        self.trainer, self.node, self.engine = trainer, node, node.engine
        self.config, self.exchange = trainer.config, trainer.plan.exchange
        self.model = trainer.model
        lr = self.model.optimizer.param_groups[0]["lr"]
        self.momentum = self.model.optimizer.param_groups[0].get("momentum", 0.0)
        self.lr = lr
        self.correction = StalenessCorrection(self.exchange.staleness, lr)
        self.state = LocalState(base=self._params())
        self.slowdown = trainer.plan.slowdown
        self._slow_rng = self.slowdown.sampler(self.config.seed, node.peer_id) if self.slowdown else None
        self.local_step = 0
        self.merges = 0
        self._steps_at_merge = 0
        self.last_loss: Optional[float] = None
        self._base_ref: Optional[torch.Tensor] = None  # the base the exchange in flight merges onto

    # ---- model access (worker thread) ---------------------------------------------------------

    def _params(self) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(self.model.params).detach().to("cpu", torch.float32).clone()

    def _momentum(self) -> Optional[torch.Tensor]:
        buffers = [self.model.optimizer.state[p].get("momentum_buffer") for p in self.model.params]
        if any(b is None for b in buffers):
            return None
        return torch.cat([b.reshape(-1) for b in buffers]).detach().to("cpu", torch.float32)

    def _set_params(self, vector: torch.Tensor) -> None:
        device = self.model.params[0].device
        torch.nn.utils.vector_to_parameters(vector.to(device).clone(), self.model.params)

    def _step(self, step: int) -> float:
        """One local step: gradient (at the look-ahead with --dana), optimizer step, Gap-Aware's statistic."""
        if self.exchange.dana:
            buffers = [self.model.optimizer.state[p].get("momentum_buffer") for p in self.model.params]
            with look_ahead(self.model.params, buffers, self.lr, self.momentum):
                loss, grad = self.trainer._contribution(self.node.peer_id, step)
        else:
            loss, grad = self.trainer._contribution(self.node.peer_id, step)
        offset = 0
        for p in self.model.params:
            p.grad = grad[offset : offset + p.numel()].view_as(p).to(p.device)
            offset += p.numel()
        self.model.optimizer.step()
        self.model.module.zero_grad(set_to_none=True)
        momentum = self._momentum()
        unpenalized = momentum if momentum is not None else grad.detach().cpu()
        if torch.isfinite(unpenalized).all():
            self.correction.observe(unpenalized)
        return loss

    # ---- the exchange ------------------------------------------------------------------------

    async def _prepare(self, group: GroupSpec) -> tuple[torch.Tensor, float]:
        """Our contribution, once the group says who holds the freshest base."""
        versions = group.versions or [self.state.version] * len(group.members)

        async def fetch(index: int) -> torch.Tensor:
            return await self._fetch_base(group.members[index], versions[index])

        part = await self.state.contribution(versions, fetch, self.correction, self.exchange.max_gap)
        self._base_ref = part.base_ref
        if part.reset_to is not None:
            logger.info(f"{part.penalty.gap_versions} versions behind (> --max-gap): taking the current model")
            await self.trainer._in_thread(self._set_params, part.reset_to)
            self.state.snapshot = part.reset_to.clone()
        elif part.penalty.gap_versions > 0:
            logger.info(
                f"stale contribution ({part.penalty.gap_versions} versions behind): "
                f"{part.penalty.method} divided it by {part.penalty.mean_divisor:.2f} on average"
            )
        if part.penalty.gap_versions > 0:
            self.trainer.health.staleness_penalty = part.penalty.mean_divisor
            self.trainer._emit("penalty", gap=part.penalty.gap_versions, method=part.penalty.method, divisor=part.penalty.mean_divisor)
        update = part.update
        if self.exchange.average_optimizer_state:
            momentum = await self.trainer._in_thread(self._momentum)
            update = torch.cat([update, momentum if momentum is not None else torch.zeros_like(update)])
        return update, part.weight

    async def _fetch_base(self, donor: str, version: int) -> torch.Tensor:
        template = {"base": self.state.base}
        timeout_s = self.trainer.plan.round.allreduce_timeout_s
        snapshot = await self.engine.state.fetch(donor, BASE_KEY, template, timeout_s=timeout_s)
        if snapshot.step != version:
            raise PeerProtocolError(f"base of version {snapshot.step}, expected {version}", peer=donor)
        return snapshot.tensors["base"]

    def _merge(self, averaged: torch.Tensor, group: GroupSpec) -> None:
        """b' = b_ref + avg(u'); x ← b' + (x_now − s); optionally the momentum the same way."""
        numel = self.state.base.numel()
        new_base = self._base_ref + averaged[:numel]
        x_now = self._params()
        self._set_params(merge(new_base, x_now, self.state.snapshot))
        if self.exchange.average_optimizer_state:
            momentum = averaged[numel:]
            offset = 0
            for p in self.model.params:
                buf = self.model.optimizer.state[p].get("momentum_buffer")
                if buf is not None:
                    buf.copy_(momentum[offset : offset + p.numel()].view_as(buf))
                offset += p.numel()
        self.state.base = new_base
        self.state.version = max(group.versions or [self.state.version]) + 1

    async def _publish(self) -> None:
        self.engine.set_state(b"", self.state.version)  # joins carry the base version
        await self.engine.state.publish(
            StateSnapshot(step=self.state.version, version=b"", tensors={"base": self.state.base}), BASE_KEY
        )
        if self.merges % PUBLISH_STATE_EVERY == 0:
            tensors = await self.trainer._in_thread(self.model.state_tensors)
            await self.engine.state.publish(StateSnapshot(step=self.state.version, version=b"", tensors=tensors))

    async def _join_late(self) -> None:
        """A newcomer to a running swarm starts from a member's current model instead of from scratch."""
        peers = {p: r for p, r in self.node.membership.peers().items() if p != self.node.peer_id}
        if not peers or max(r.step for r in peers.values()) == 0:
            return
        donor = max(peers, key=lambda p: peers[p].step)
        try:
            snapshot = await self.engine.state.fetch(
                donor, None, self.model.state_tensors(), timeout_s=self.trainer.plan.round.allreduce_timeout_s
            )
        except (PhalanxError, ValueError) as e:
            logger.warning(f"could not download the swarm's model from {donor[-8:]}: {e}; starting fresh")
            return
        await self.trainer._in_thread(self.model.load_state_tensors, snapshot.tensors)
        self.state.base = await self.trainer._in_thread(self._params)
        self.state.version = snapshot.step
        self.trainer._emit("resynced", step=self.local_step, version=snapshot.step, donor=donor)
        logger.info(f"joined a running swarm: model of version {snapshot.step} from {donor[-8:]}")

    # ---- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        trainer, config, engine = self.trainer, self.config, self.engine
        if await trainer.run_unless_stopped(self._join_late()) is None:
            return
        await self._publish()
        exchange: Optional[asyncio.Task] = None
        since_exchange = 0
        try:
            while not trainer._done(self.local_step) and await trainer.check_node(self.node):
                loss = await trainer._in_thread(self._step, self.local_step)
                self.last_loss = loss
                self.local_step += 1
                since_exchange += 1
                if self.slowdown is not None:
                    await trainer._sleep_or_stop(self.slowdown.draw(self._slow_rng))
                if exchange is None and since_exchange >= self.exchange.sync_every:
                    self.state.snapshot = await trainer._in_thread(self._params)
                    exchange = asyncio.create_task(engine.run_round(prepare=self._prepare))
                    since_exchange = 0
                if exchange is not None and exchange.done():
                    await self._finish(exchange)
                    exchange = None
                trainer.report.loss = loss
                trainer._local_progress(self.local_step, loss, engine)
                if self.local_step % config.eval_every == 0 or (config.steps and self.local_step >= config.steps):
                    await trainer._evaluate(self.local_step)
                if config.checkpoint_dir is not None and self.local_step % config.checkpoint_every == 0:
                    await trainer._in_thread(trainer._checkpoint, self.local_step)
        finally:
            if exchange is not None:
                exchange.cancel()
                await asyncio.gather(exchange, return_exceptions=True)

    async def _finish(self, exchange: asyncio.Task) -> None:
        engine = self.engine
        try:
            outcome = exchange.result()
        except (RoundAbortedError, RoundTimeoutError, PeerProtocolError) as e:
            engine.stats.rounds_failed += 1
            self.trainer.health.round_failed()
            logger.info(f"exchange failed: {e}")
            return
        if not isinstance(outcome, Averaged):
            return
        started = time.monotonic()
        averaged = outcome.result.vector.clone()  # the engine reuses its buffer next round
        await self.trainer._in_thread(self._merge, averaged, outcome.group)
        self.merges += 1
        await self._publish()
        steps = self.local_step - self._steps_at_merge
        self._steps_at_merge = self.local_step
        self.trainer.health.round_done(
            step=self.local_step, loss=self.last_loss or 0.0, samples=steps * self.trainer.batch_size,
            averaged=outcome, duration_s=engine.stats.last_round_s,
        )  # fmt: skip
        self.trainer.report.group_size = len(outcome.group.members)
        logger.debug(f"merged version {self.state.version} in {time.monotonic() - started:.3f} s")
