"""`phalanx.Optimizer`: your model, optimizer and training loop, on a swarm.

    opt = phalanx.Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), run_id="my-run",
                            initial_peers=[...], batch_size_per_step=32, target_batch_size=4096)
    for batch in data:
        loss = model(batch).loss
        loss.backward()
        opt.step()        # a local step adds this batch's gradient; a global step averages with the swarm
        opt.zero_grad()

Each `step()` adds the batch's gradient (weighted by `batch_size_per_step`) to a local sum. Once
this peer's share of `target_batch_size` is in (the target divided among the trainers it sees), the
peer joins a round: the swarm averages the members' mean gradients weighted by their sample counts,
which is the gradient of the union of their batches, and every peer hands that to its own optimizer
for one step. So the wrapped optimizer (AdamW's moments included) steps on identical gradients on
every peer and its state stays identical without being sent; a newcomer downloads it with the
parameters (`load_state_from_peers`, or automatically at its first round).

With mode="lasgd" (or "gossip") every `step()` is a step of the wrapped optimizer that never waits:
every `sync_every` steps an exchange of the progress since the last average starts in the background
and is merged at a later `step()`. mode="diloco" takes `inner_steps` steps, then an outer step;
verified, its validators replay a member's phase. Each mode is a class of peer/modes/ (`opt.mode`),
which does what a step does; this class keeps the swarm's thread, opening and closing, `interrupt()`
and the LR scheduler.

The node (DHT, transport, rounds) lives on an event loop in a thread of its own; `step()` blocks
the caller's thread only while a round runs, and `interrupt()` (from a signal handler, say) ends that
wait. `phalanx join` is a loop over this class too (peer/trainer.py, through `Optimizer.for_plan`).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from phalanx.errors import ConfigError, PhalanxError
from phalanx.peer.health import PeerMetrics, open_node_health
from phalanx.peer.model import Trainable
from phalanx.peer.modes.base import Interrupted, JoinHooks, Mode, PublicBatches, Swarm
from phalanx.peer.modes.diloco import DiLoCoMode
from phalanx.peer.modes.local import LocalMode
from phalanx.peer.modes.sync import SyncMode
from phalanx.peer.node import Node, open_node, wait_for_trainers
from phalanx.peer.node_loop import SwarmLoop
from phalanx.peer.optimizer_arguments import JOIN_ONLY, check_arguments, make_inner, plan_for, refuse_join_settings
from phalanx.peer.plan import PeerPlan
from phalanx.protocol.round_counts import RoundCounts

__all__ = ["API_MODES", "JOIN_ONLY", "Interrupted", "JoinHooks", "Optimizer", "Statistics"]

logger = logging.getLogger(__name__)

# name → the class that runs it (peer/modes/); peer/modes/__init__.py's registry has the same names
MODE_CLASSES: dict[str, type[Mode]] = {"sync": SyncMode, "lasgd": LocalMode, "gossip": LocalMode, "diloco": DiLoCoMode}
API_MODES = tuple(MODE_CLASSES)
Scheduler = Union[torch.optim.lr_scheduler.LRScheduler, Callable[[torch.optim.Optimizer], Any]]


@dataclass
class Statistics:
    """What a peer knows about its swarm after its last global step."""

    global_step: int
    """Global steps (rounds applied) of the state this peer holds; lasgd/gossip: averages behind its base."""
    local_samples: int
    """Samples accumulated since the last global step."""
    samples_per_round: int
    """This peer's share of target_batch_size: samples it accumulates before joining a round."""
    peers_last_round: int
    """Members of the last round this peer applied."""
    last_round: Optional[str]
    """ok, partial (some parts were lost), failed, resynced (downloaded the swarm's state), or None."""
    rounds: RoundCounts
    """This peer's rounds since it started, by outcome (`rounds.ok`, `.partial`, `.failed`, `.resyncs`)."""
    bytes_sent: int
    bytes_received: int
    staleness_penalty: Optional[float]
    """The last staleness correction's factor; None in sync mode, where nothing is stale."""
    banned: list[str] = field(default_factory=list)
    """Peers the swarm banned, as this peer knows."""


@dataclass
class _Setup:
    """What both doors (the library's arguments, `phalanx join`'s plan) come down to."""

    plan: PeerPlan
    trainable: Trainable
    batch_size_per_step: int
    target_batch_size: Optional[int] = None
    model: Optional[torch.nn.Module] = None
    batch_fn: Optional[Callable[[int, str, int], Any]] = None
    loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None
    scheduler: Optional[Scheduler] = None
    hooks: JoinHooks = field(default_factory=JoinHooks)
    state: Optional[dict[str, Any]] = None  # a checkpoint's state_dict() to start from
    node: Optional[Node] = None  # the caller's, instead of one of its own


class Optimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (an instance, or a factory called with `params`) and joins the swarm `run_id`.

    Swarm settings are those of `phalanx join`, by the flags' names with underscores (`initial_peers`,
    `identity_path`, `host_maddrs`, `aggregator`, `compression`, `matchmaking_timeout_s`, `http_port`,
    ...), given as arguments only: `PHALANX_*` environment variables configure the `phalanx` command,
    and a script's settings stay in the script. The settings of `phalanx join`'s own loop (its task,
    steps, evaluation, checkpoints: `JOIN_ONLY`) are refused, with what to do instead. Peers meet only
    if their run id, parameter shapes, optimizer hyperparameters, batch sizes and round settings agree.
    `scheduler` (an LR scheduler, or a factory called with the wrapped optimizer) steps once per global
    step, so every peer's learning rate follows the swarm's step. What only one mode has (diloco's outer
    state, say) is on `opt.mode`. `node` (as hivemind's optimizer takes `dht=`) trains over a node the
    caller opened and closes instead of opening one, with no health service: tests give a stand-in for
    the swarm, so what needs no network runs without one.
    """

    def __init__(
        self,
        optimizer: Union[torch.optim.Optimizer, Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer], _Setup],
        params: Optional[Iterable[torch.Tensor]] = None,
        *,
        run_id: str,
        batch_size_per_step: int,
        target_batch_size: Optional[int] = None,
        mode: str = "sync",
        scheduler: Optional[Scheduler] = None,
        verify: bool = False,
        model: Optional[torch.nn.Module] = None,
        batch_fn: Optional[Callable[[int, str, int], Any]] = None,
        loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
        seed: int = 0,
        node: Optional[Node] = None,
        **settings: Any,
    ) -> None:
        if isinstance(optimizer, _Setup):  # for_plan's: run_id and batch_size_per_step are in it
            self._start(optimizer)
            return
        refuse_join_settings(settings)
        inner = make_inner(optimizer, params)
        check_arguments(
            batch_size_per_step, target_batch_size, verify, {"model": model, "batch_fn": batch_fn, "loss_fn": loss_fn}
        )
        if mode not in API_MODES:
            raise ConfigError(f"phalanx.Optimizer(mode={mode!r}): no such mode; use one of {', '.join(API_MODES)}")
        MODE_CLASSES[mode].check_settings(mode, target_batch_size, settings)
        plan = plan_for(inner, run_id, mode, batch_size_per_step, target_batch_size, seed, verify, settings)
        trainable = Trainable([p for g in inner.param_groups for p in g["params"]], inner)
        self._start(
            _Setup(
                plan, trainable, batch_size_per_step, target_batch_size, model, batch_fn, loss_fn, scheduler, node=node
            )
        )

    @classmethod
    def for_plan(
        cls,
        plan: PeerPlan,
        trainable: Trainable,
        *,
        model: torch.nn.Module,
        batch_fn: Callable[[int, str, int], Any],
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        batch_size_per_step: int,
        scheduler: Optional[Scheduler] = None,
        hooks: Optional[JoinHooks] = None,
        state: Optional[dict[str, Any]] = None,
    ) -> Optimizer:
        """`phalanx join`'s door: a plan its flags made (checked there, so settings the library refuses
        for a loop it cannot see into, DANA's look-ahead and averaged momentum, pass), a task's model and
        optimizer as `trainable` (its buffers travel with the state), the loop's hooks, and the
        `state_dict()` of a checkpoint to start from (loaded before the node announces its step)."""
        hooks = hooks or JoinHooks()
        setup = _Setup(plan, trainable, batch_size_per_step, None, model, batch_fn, loss_fn, scheduler, hooks, state)
        return cls(setup, run_id=plan.network.run_id, batch_size_per_step=batch_size_per_step)

    def _start(self, setup: _Setup) -> None:
        inner, plan = setup.trainable.optimizer, setup.plan
        self.model, self.batch_fn, self.loss_fn, self.seed = (
            setup.model,
            setup.batch_fn,
            setup.loss_fn,
            plan.training.seed,
        )
        given = (setup.model, setup.batch_fn, setup.loss_fn)  # what validators recompute a step from
        public = PublicBatches(*given, self.seed) if all(f is not None for f in given) else None
        self.inner = None  # add_param_group, which torch's __init__ calls, tells the first call by it
        super().__init__(list(setup.trainable.params), inner.defaults)
        self.param_groups, self.state = inner.param_groups, inner.state  # one set: schedulers and users see the inner's
        self.inner = inner
        self.batch_size_per_step, self.target_batch_size = setup.batch_size_per_step, setup.target_batch_size
        self.trainable, self.plan, self.hooks = setup.trainable, plan, setup.hooks
        scheduler = setup.scheduler
        self.scheduler = scheduler(inner) if callable(scheduler) and not hasattr(scheduler, "step") else scheduler
        self._scheduled = 0  # steps of the schedule the scheduler has taken
        self.metrics = setup.hooks.metrics or PeerMetrics(role="trainer")  # what the health server shows
        self._health = None
        self._owns_node = setup.node is None
        self._closed = False
        self._loop = SwarmLoop()
        self._swarm = Swarm(
            plan, setup.trainable, setup.hooks, self.metrics, self._loop, setup.batch_size_per_step,
            setup.target_batch_size, public,
        )  # fmt: skip
        try:
            self.mode: Mode = MODE_CLASSES[plan.training.mode](self._swarm)
            self.node: Node = self._loop.call(self._open(setup))
        except BaseException:
            self._loop.close()
            raise
        atexit.register(self.close)

    # ---- the user's loop ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """A local step: add this batch's gradients; when this peer's share is in, a global step (the
        mode says what a step does: peer/modes/)."""
        if self._closed:
            raise PhalanxError("phalanx.Optimizer.step() after close(): make a new optimizer to rejoin")
        if self._swarm.interrupted.is_set():
            raise Interrupted("phalanx.Optimizer.step() after interrupt()")
        loss = self.mode.step(closure)
        if isinstance(loss, torch.Tensor):
            self._swarm.last_loss = float(loss.detach())
        self._follow_schedule()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "inner", None) is None:  # torch.optim.Optimizer.__init__ adds the first one
            return super().add_param_group(param_group)
        raise ConfigError(
            "phalanx.Optimizer: parameters are fixed once the swarm is joined; give them all to the wrapped optimizer"
        )

    def load_state_from_peers(self) -> bool:
        """Download the swarm's parameters, optimizer state and step (a newcomer's first call); False
        when no peer with a state was ready to hand one over within the join timeout."""
        taken = self.mode.load_state_from_peers()
        self._follow_schedule()
        return taken

    def public_batch(self) -> Any:
        """With verify: this peer's batch of the current step, `batch_fn(seed, peer_id, position)` (diloco:
        of the current inner step, H per outer step). Compute the loss on exactly this (and nothing else
        changes the gradient, no clipping): the validators recompute it (diloco: replay the phase) and the
        swarm bans a peer whose contribution differs."""
        if self.batch_fn is None:
            raise ConfigError("phalanx.Optimizer.public_batch() needs batch_fn= (verified runs)")
        return self.batch_fn(self.seed, self.node.peer_id, self.position)

    # ---- what users asked for ----------------------------------------------------------------

    @property
    def global_step(self) -> int:
        return self.node.engine.step

    @property
    def position(self) -> int:
        """Steps of this peer's schedule (what LR schedulers follow): global steps in sync mode, inner
        steps in diloco (H per outer step begun, plus those since), local steps in lasgd and gossip."""
        return self.mode.position

    @property
    def validating(self) -> Optional[str]:
        """Verified diloco: the member whose phase this peer replays instead of training its own;
        `step()` then calls no closure (peer/modes/diloco.py)."""
        return self.mode.validating

    @property
    def swarm_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (on a thread of its own) the node runs on."""
        return self._loop.loop

    def interrupt(self) -> None:
        """From any thread (a signal handler): a `step()` waiting for a round to form, or in a back-off,
        raises Interrupted soon after; a round whose group has formed is finished first (within its
        deadlines), so its other members get this peer's part. Rounds in the background are left.
        Steps after it raise too."""
        self._swarm.interrupted.set()
        stop = self._swarm.stop
        if stop is not None and not self._closed:
            try:
                self._loop.loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # closed meanwhile: nothing waits any more
                pass

    def statistics(self) -> Statistics:
        node, swarm, mine = self.node.snapshot(), self._swarm, self.mode.statistics()
        return Statistics(
            global_step=node.step,
            local_samples=mine.local_samples,
            samples_per_round=mine.samples_per_round,
            peers_last_round=swarm.peers_last_round,
            last_round=swarm.last_round,
            rounds=node.rounds,
            bytes_sent=node.bytes_sent,
            bytes_received=node.bytes_received,
            staleness_penalty=mine.staleness_penalty,
            banned=list(node.banned),
        )

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the global step and the mode's part (diloco: θ_t and v; lasgd
        and gossip: the base of the next exchange), the top-k residual and the scheduler."""
        mine = self.mode.state_dict()  # first: diloco lands a round in flight, which moves the global step
        state = {"optimizer": self.inner.state_dict(), "global_step": self.global_step, **mine}
        feedback = self.mode.feedback
        if feedback is not None:  # top-k: what this peer contributed and has not sent yet
            state["topk_residual"] = feedback.residual.detach().cpu().clone()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _load_residual(self, residual: Optional[torch.Tensor]) -> None:
        """A checkpoint's top-k residual, so a resumed peer still sends what it had not (one without it, from
        before top-k or an older phalanx, leaves the residual empty)."""
        feedback = self.mode.feedback
        if feedback is None:
            if residual is not None:
                logger.info("the checkpoint's top-k residual is dropped: this run does not use --compression topk")
            return
        if residual is None:
            feedback.residual.zero_()
            return
        if residual.numel() != feedback.residual.numel():
            raise ConfigError(
                f"phalanx.Optimizer.load_state_dict: the checkpoint's top-k residual has {residual.numel()} values, "
                f"the model {feedback.residual.numel()}; load a checkpoint of this model"
            )
        feedback.residual.copy_(residual.reshape(-1).to(feedback.residual.device, torch.float32))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of `state_dict()`; peers that load the same one (and the same parameters)
        hold the same version and train on together, the others resync at their first round."""
        if not isinstance(state_dict, dict) or "optimizer" not in state_dict or "global_step" not in state_dict:
            raise ConfigError("phalanx.Optimizer.load_state_dict: give what phalanx.Optimizer.state_dict() returned")
        self._loop.call(self._load_state(state_dict))

    async def _load_state(self, state_dict: dict[str, Any]) -> None:
        """load_state_dict's work, on the node's loop while the caller's thread waits (the parameters hold still)."""
        self._load_residual(state_dict.get("topk_residual"))  # first: its size check changes nothing else
        self.inner.load_state_dict(state_dict["optimizer"])
        await self.mode.load_state(state_dict, int(state_dict["global_step"]))
        if self.scheduler is not None and "scheduler" in state_dict:
            self.scheduler.load_state_dict(state_dict["scheduler"])
            self._scheduled = self.position
        self._follow_schedule()

    def close(self) -> None:
        """Leave the swarm: stop the node (its DHT process and p2p daemon too) and the loop's thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.mode.close()
        try:
            self._loop.call(self._aclose())
        finally:
            self._loop.close()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- inside ------------------------------------------------------------------------------

    async def _open(self, setup: _Setup) -> Node:
        swarm = self._swarm
        stop = swarm.stop = asyncio.Event()
        opened = setup.node if setup.node is not None else await open_node(self.plan, loss=lambda: swarm.last_loss)
        node = self.node = swarm.node = opened
        try:
            await self.mode.open()
            if self._owns_node:  # a given node's health service, if any, is the caller's
                self._health = await open_node_health(node, self.plan, self.metrics)
            if setup.state is not None:
                await self._load_state(setup.state)
            hooked = self.hooks.opened(self)
            if inspect.isawaitable(hooked):
                await hooked
            await wait_for_trainers(node, self.plan.training.wait_for_peers, stop)
            if stop.is_set():
                raise Interrupted("interrupted while waiting for the other trainers")
            await self.mode.joined()
        except BaseException:
            await self._aclose()
            raise
        return node

    async def _aclose(self) -> None:
        if self._health is not None:
            await self._health.aclose()
        if self._owns_node:
            await self.node.aclose()

    def _follow_schedule(self) -> None:
        """Step the scheduler to the position (diloco: the inner step, H per outer step); a newcomer's
        catches up with the swarm's."""
        if self.scheduler is None:
            return
        position = self.position
        with warnings.catch_warnings():  # a newcomer's schedule catches up before its optimizer ever stepped
            warnings.filterwarnings(
                "ignore", message=r"Detected call of `lr_scheduler.step\(\)` before", category=UserWarning
            )
            while self._scheduled < position:
                self.scheduler.step()
                self._scheduled += 1
