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
and is merged at a later `step()` (peer/local_exchange.py). mode="diloco" takes `inner_steps` steps,
then an outer step (peer/outer_step.py); verified, its validators replay a member's phase
(peer/phase_replay.py).

The node (DHT, transport, rounds) lives on an event loop in a thread of its own; `step()` blocks
the caller's thread only while a round runs, and `interrupt()` (from a signal handler, say) ends that
wait. `phalanx join` is a loop over this class too (peer/trainer.py, through `Optimizer.for_plan`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import hashlib
import inspect
import json
import logging
import math
import re
import secrets
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar, Union

import torch
from pydantic import ValidationError

from phalanx.aggregation.compression import ErrorFeedback
from phalanx.aggregation.errors import ConfigError, PhalanxError
from phalanx.peer.attacks import GRADIENT_ATTACKS
from phalanx.peer.config import PeerConfig, environment_settings, settings_from_arguments
from phalanx.peer.global_step import GlobalStep
from phalanx.peer.health import PeerMetrics, open_node_health
from phalanx.peer.local_exchange import LocalExchange
from phalanx.peer.model import Trainable
from phalanx.peer.node import DHT_DIED, Node, open_node, quiet_p2p_daemon_noise, wait_for_trainers
from phalanx.peer.outer_step import OuterStep, phase_lr_scale, write_flat
from phalanx.peer.phase_replay import PhaseReplay
from phalanx.peer.plan import PeerPlan, make_plan
from phalanx.protocol.btard.validator import drawn_to_sit_out
from phalanx.protocol.engine import ROUND_FAILURES, Averaged, Resync, initial_version

logger = logging.getLogger(__name__)

T = TypeVar("T")
API_MODES = ("sync", "lasgd", "gossip", "diloco")
_CHECKPOINTS = "save opt.state_dict() beside your model's state_dict() and load both back (opt.load_state_dict())"
_TASKS = "your script builds the model and feeds it its data (tasks are `phalanx join --task`'s)"
# Settings of `phalanx join`'s own loop around the optimizer (peer/trainer.py), which a script does itself:
# each with what to do instead. Every other setting of `phalanx join` configures the swarm here too
# (tests/peer/test_optimizer.py checks that each of the trainer's settings is one or the other).
JOIN_ONLY = {
    "task": _TASKS, "task_options": _TASKS, "data_dir": _TASKS, "data_file": _TASKS,
    "device": "move the model to its device before you make its optimizer",
    "batch_size": "give batch_size_per_step= (the samples of one step)",
    "lr": "set it on the optimizer you wrap (e.g. torch.optim.SGD(params, lr=0.1))",
    "momentum": "set it on the optimizer you wrap (e.g. torch.optim.SGD(params, lr=0.1, momentum=0.9))",
    "weight_decay": "set it on the optimizer you wrap (e.g. torch.optim.AdamW(params, weight_decay=0.01))",
    "steps": "end your loop after as many steps",
    "target_accuracy": "evaluate in your loop and end it there",
    "target_loss": "evaluate in your loop and end it there",
    "eval_every": "evaluate in your loop as often as you like",
    "checkpoint_dir": _CHECKPOINTS, "checkpoint_every": _CHECKPOINTS, "checkpoint_keep": _CHECKPOINTS, "resume": _CHECKPOINTS,
    "torch_threads": "call torch.set_num_threads() in your script",
    "events": "read opt.statistics() in your loop",
    "slowdown": "sleep in your loop (a straggler for demos and tests)",
}  # fmt: skip
LOCAL_MODES = ("lasgd", "gossip")  # local steps never wait; an exchange every sync_every steps runs meanwhile
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
    rounds_ok: int
    rounds_partial: int
    rounds_failed: int
    resyncs: int
    bytes_sent: int
    bytes_received: int
    staleness_penalty: Optional[float]
    """The last staleness correction's factor; None in sync mode, where nothing is stale."""
    banned: list[str] = field(default_factory=list)
    """Peers the swarm banned, as this peer knows."""


class Interrupted(PhalanxError):
    """`step()` (or the constructor's wait) gave up because `interrupt()` was called."""


@dataclass
class JoinHooks:
    """What `phalanx join`'s loop adds to the optimizer (library users leave it empty)."""

    opened: Callable[[Optimizer], Any] = lambda optimizer: None
    """Called (on the node's loop; it may return an awaitable) once the node is up and holds the state
    it starts from, before waiting for the other trainers."""
    contribute: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None
    """diloco: (outer step, honest Δ) → what this peer sends instead (`--attack`)."""
    event: Callable[..., None] = lambda name, **fields: None
    """Called with "resynced" (donor=) and "penalty" (gap=, method=, divisor=), as they happen."""
    metrics: Optional[PeerMetrics] = None
    """The health server's metrics, when the caller shows them too."""


class _SwarmThread:
    """An event loop on a thread of its own, where the node lives; callers wait on its results."""

    def __init__(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.loop.set_exception_handler(quiet_p2p_daemon_noise)
        self.thread = threading.Thread(target=self.loop.run_forever, name="phalanx-swarm", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what still runs on the loop (a round's reducer left behind, say) and wait for it, so no
        task is destroyed pending; then stop the loop and its thread."""

        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.wait(rest, timeout=10) if rest else None

        if self.thread.is_alive() and not self.loop.is_closed():
            try:
                self.submit(cancel_the_rest()).result(timeout=15)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


class Optimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (an instance, or a factory called with `params`) and joins the swarm `run_id`.

    Swarm settings are those of `phalanx join`, by the flags' names with underscores (`initial_peers`,
    `identity_path`, `host_maddrs`, `aggregator`, `compression`, `matchmaking_timeout_s`, `http_port`,
    ...), given as arguments only: `PHALANX_*` environment variables configure the `phalanx` command,
    and a script's settings stay in the script. The settings of `phalanx join`'s own loop (its task,
    steps, evaluation, checkpoints: `JOIN_ONLY`) are refused, with what to do instead. Peers meet only
    if their run id, parameter shapes, optimizer hyperparameters, batch sizes and round settings agree.
    `scheduler` (an LR scheduler, or a factory called with the wrapped optimizer) steps once per global
    step, so every peer's learning rate follows the swarm's step.
    """

    def __init__(
        self,
        optimizer: Union[torch.optim.Optimizer, Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]],
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
        **settings: Any,
    ) -> None:
        _refuse_join_settings(settings)
        inner = _make_inner(optimizer, params)
        if not isinstance(batch_size_per_step, int) or batch_size_per_step < 1:
            raise ConfigError(
                f"phalanx.Optimizer(batch_size_per_step={batch_size_per_step!r}): give the samples of one step, ≥ 1"
            )
        if target_batch_size is not None and (
            not isinstance(target_batch_size, int) or target_batch_size < batch_size_per_step
        ):
            raise ConfigError(
                f"phalanx.Optimizer(target_batch_size={target_batch_size!r}): give the samples of one global step, "
                f"≥ batch_size_per_step ({batch_size_per_step}), or None for a round every step"
            )
        if mode not in API_MODES:
            raise ConfigError(f"phalanx.Optimizer(mode={mode!r}): no such mode; use one of {', '.join(API_MODES)}")
        if mode in LOCAL_MODES:
            _check_local_settings(mode, target_batch_size, settings)
        if verify:
            given = (("model", model), ("batch_fn", batch_fn), ("loss_fn", loss_fn))
            missing = [name for name, value in given if value is None]
            if missing:
                raise ConfigError(
                    "phalanx.Optimizer(verify=True): validators recompute a peer's gradient from its public batch; "
                    f"pass {', '.join(missing)} (model, batch_fn(seed, peer_id, step) -> batch, loss_fn(model, batch) -> loss)"
                )
            if target_batch_size is not None:
                raise ConfigError(
                    "phalanx.Optimizer(verify=True, target_batch_size=...): validators recompute one public batch "
                    "per global step; drop target_batch_size (or make the batch bigger)"
                )
        plan = _plan(inner, run_id, mode, batch_size_per_step, target_batch_size, seed, verify, settings)
        trainable = Trainable([p for g in inner.param_groups for p in g["params"]], inner)
        self._start(plan, trainable, batch_size_per_step, target_batch_size, model, batch_fn, loss_fn, scheduler, JoinHooks())

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
        self = cls.__new__(cls)
        self._initial_state = state
        self._start(plan, trainable, batch_size_per_step, None, model, batch_fn, loss_fn, scheduler, hooks or JoinHooks())
        return self

    def _start(
        self,
        plan: PeerPlan,
        trainable: Trainable,
        batch_size_per_step: int,
        target_batch_size: Optional[int],
        model: Optional[torch.nn.Module],
        batch_fn: Optional[Callable[[int, str, int], Any]],
        loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]],
        scheduler: Optional[Scheduler],
        hooks: JoinHooks,
    ) -> None:
        inner, training = trainable.optimizer, plan.training
        mode, verify, seed = training.mode, plan.round.verify is not None, training.seed
        self.model, self.batch_fn, self.loss_fn, self.seed = model, batch_fn, loss_fn, seed
        self._validator_model: Optional[torch.nn.Module] = None
        self.inner = None  # add_param_group, which torch's __init__ calls, tells the first call by it
        super().__init__(list(trainable.params), inner.defaults)
        self.param_groups, self.state = inner.param_groups, inner.state  # one set: schedulers and users see the inner's
        self.inner = inner
        self.batch_size_per_step, self.target_batch_size = batch_size_per_step, target_batch_size
        self.trainable, self.plan, self.hooks = trainable, plan, hooks
        if verify:
            assert model is not None
            self._model_index = {id(p): i for i, p in enumerate(model.parameters())}
            if any(id(p) not in self._model_index for p in self.trainable.params):
                raise ConfigError(
                    "phalanx.Optimizer(verify=True, model=...): the model must hold every parameter the optimizer steps"
                )
        # verified diloco: validators replay a member's H inner steps (peer/phase_replay.py)
        self._replay = PhaseReplay(model, inner, batch_fn, loss_fn, seed) if verify and mode == "diloco" else None
        self.scheduler = scheduler(inner) if callable(scheduler) and not hasattr(scheduler, "step") else scheduler
        self._scheduled = 0  # global steps the scheduler has taken
        self._last_loss: Optional[float] = None
        self._last_round: Optional[str] = None
        self._peers_last_round = 0
        self.metrics = hooks.metrics or PeerMetrics(role="trainer")  # what the health server shows
        self._health = None
        self._outer: Optional[OuterStep] = None  # diloco's outer step
        self._local: Optional[LocalExchange] = None  # lasgd/gossip's exchange; else self._steps is a GlobalStep
        self._in_flight: Optional[concurrent.futures.Future] = None  # diloco, lasgd, gossip: the round running
        self._local_steps = 0  # lasgd/gossip: local steps taken (the schedule follows them)
        self._since_exchange = 0
        self._lr_max = max(g.get("initial_lr", g["lr"]) for g in inner.param_groups)
        self._initial_state: Optional[dict[str, Any]] = getattr(self, "_initial_state", None)
        self._closed = False
        self._interrupted = threading.Event()
        self._stop: Optional[asyncio.Event] = None  # the same, on the swarm's loop (set there by interrupt())
        self._swarm = _SwarmThread()
        try:
            self.node: Node = self._swarm.call(self._open())
        except BaseException:
            self._swarm.close()
            raise
        atexit.register(self.close)

    # ---- the user's loop ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """A local step: add this batch's gradients; when this peer's share is in, a global step."""
        if self._closed:
            raise PhalanxError("phalanx.Optimizer.step() after close(): make a new optimizer to rejoin")
        if self._interrupted.is_set():
            raise Interrupted("phalanx.Optimizer.step() after interrupt()")
        loss = None
        # a verified diloco peer sitting a phase out replays another member's instead: no closure is called
        if closure is not None and self.validating is None:
            with torch.enable_grad():
                loss = closure()
        if self._local is not None:  # lasgd/gossip: a local step; an exchange starts or lands around it
            self._local_step()
        elif self._outer is not None:  # diloco: the inner optimizer steps on this batch's gradient, here
            if self._replay is not None:
                replayed = self._verified_inner_step()
                loss = replayed if replayed is not None else loss
            else:
                self.inner.step()
            self._outer.inner_step_done()
            self._outer_boundary()
        else:
            params = self.trainable.params
            self._steps.add(
                torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            )
            if self._steps.ready:
                self._global_step()
        if isinstance(loss, torch.Tensor):
            self._last_loss = float(loss.detach())
        self._follow_schedule()
        return loss

    @property
    def validating(self) -> Optional[str]:
        """Verified diloco: the member whose phase this peer replays instead of training its own (the
        previous round's seed drew it to sit this phase out; it picked the member in secret). `step()`
        then calls no closure and ignores the gradients: pass the loss as a closure to save computing them."""
        return self._outer.sitting if self._outer is not None else None

    def _verified_inner_step(self) -> Optional[torch.Tensor]:
        """A phase starts from a fresh inner state, its first steps at a learning rate ramping up over
        phase_warmup steps (what the schedule gives, scaled for this step only), and each step's
        hyperparameters are recorded for validators' replays of other members' phases. A peer sitting
        the phase out takes the replay's step instead (its parameters stay at θ_t) and returns its loss."""
        outer, replay = self._outer, self._replay
        assert outer is not None and replay is not None
        if outer.inner == 0:
            replay.phase_starts()
        scale = phase_lr_scale(outer.inner, self.plan.outer.phase_warmup)
        scheduled = [g["lr"] for g in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = group["lr"] * scale
        try:
            replay.record(outer.position)
            if outer.sitting is None:
                self.inner.step()
                return None
            loss = replay.step(outer.position)
            if outer.inner + 1 >= outer.inner_steps:
                replay.finish()
            return loss
        finally:
            for group, lr in zip(self.inner.param_groups, scheduled, strict=True):
                group["lr"] = lr

    def _sit_out_next_phase(self, outcome: Union[Averaged, Resync]) -> None:
        """Verified diloco, after a round landed: when its seed draws this peer as a validator, the next
        phase replays a member picked in secret (the member must not know it is checked while it trains)."""
        outer, replay, verify = self._outer, self._replay, self.plan.round.verify
        if outer is None or replay is None or verify is None or not verify.validators_sit_out:
            return
        outer.sitting = None
        replay.abandon()
        verdict = outcome.verdict if isinstance(outcome, Averaged) else None
        if verdict is None or not verdict.seed:
            return
        me = self.node.peer_id
        drawn = drawn_to_sit_out(verdict.seed, list(verdict.committed), verify.validators)
        # not another drawn validator: it sits the phase out too
        others = [p for p in verdict.committed if p not in drawn and p not in self.node.membership.banned]
        if me not in drawn or not others:
            return
        outer.sitting = secrets.SystemRandom().choice(others)
        replay.begin(outer.sitting, outer.step * outer.inner_steps, outer.anchor, outer.params)
        logger.info(f"outer step {outer.step}: sitting this phase out to replay {outer.sitting[-8:]}'s")

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
        if self._local is not None:
            return self._swarm.call(self._join_late(self.node))
        snapshot = self._swarm.call(self.node.engine.fetch_swarm_state(self._steps.state_tensors()))
        if snapshot is None:
            return False
        self.node.engine.set_state(snapshot.version, snapshot.step)
        self._steps.load_state_tensors(snapshot.tensors)
        self._follow_schedule()
        self._last_round = "resynced"
        return True

    def public_batch(self) -> Any:
        """With verify: this peer's batch of the current global step, `batch_fn(seed, peer_id, step)`
        (diloco: of the current inner step, H per outer step). Compute the loss on exactly this (and
        nothing else changes the gradient, no clipping): the validators recompute it (diloco: replay the
        phase) and the swarm bans a peer whose contribution differs."""
        if self.batch_fn is None:
            raise ConfigError("phalanx.Optimizer.public_batch() needs batch_fn= (verified runs)")
        step = self.global_step if self._outer is None else self._outer.position
        return self.batch_fn(self.seed, self.node.peer_id, step)

    # ---- what users asked for ----------------------------------------------------------------

    @property
    def global_step(self) -> int:
        return self.node.engine.step

    @property
    def position(self) -> int:
        """Steps of this peer's schedule (what LR schedulers follow): global steps in sync mode, inner
        steps in diloco (H per outer step begun, plus those since), local steps in lasgd and gossip."""
        if self._local is not None:
            return self._local_steps
        return self.global_step if self._outer is None else self._outer.position

    @property
    def outer(self) -> Optional[OuterStep]:
        """diloco's outer state (θ_t as `outer.anchor`, v as `outer.momentum`); None in other modes."""
        return self._outer

    @property
    def swarm_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (on a thread of its own) the node runs on."""
        return self._swarm.loop

    @property
    def round_in_flight(self) -> bool:
        """diloco, lasgd, gossip: a round started at a boundary runs in the background."""
        return self._in_flight is not None

    def flush(self) -> None:
        """diloco: wait for the round in flight and apply it (the end of a run); a no-op otherwise."""
        if self._outer is not None and self._in_flight is not None:
            self._land_outer()

    def interrupt(self) -> None:
        """From any thread (a signal handler): a `step()` waiting for a round to form, or in a back-off,
        raises Interrupted soon after; a round whose group has formed is finished first (within its
        deadlines), so its other members get this peer's part. Rounds in the background are left.
        Steps after it raise too."""
        self._interrupted.set()
        if self._stop is not None and not self._closed:
            try:
                self._swarm.loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # closed meanwhile: nothing waits any more
                pass

    def statistics(self) -> Statistics:
        engine, transport = self.node.engine, self.node.transport
        s = engine.stats
        if self._local is not None:
            local_samples = self._since_exchange * self.batch_size_per_step
            per_round = self.plan.exchange.sync_every * self.batch_size_per_step
        elif self._outer is not None:
            local_samples = self._outer.inner * self.batch_size_per_step
            per_round = self._outer.inner_steps * self.batch_size_per_step
        else:
            local_samples, per_round = self._steps.samples, self._steps.share
        penalties = self._local.state.penalties if self._local is not None else []
        return Statistics(
            global_step=engine.step,
            local_samples=local_samples,
            samples_per_round=per_round,
            peers_last_round=self._peers_last_round,
            last_round=self._last_round,
            rounds_ok=s.rounds_ok,
            rounds_partial=s.rounds_partial,
            rounds_failed=s.rounds_failed,
            resyncs=s.resyncs,
            bytes_sent=transport.stats.bytes_sent,
            bytes_received=transport.stats.bytes_received,
            staleness_penalty=penalties[-1].mean_divisor if penalties else None,
            banned=sorted(self.node.membership.banned),
        )

    def state_dict(self) -> dict[str, Any]:
        """diloco lands a round still in flight first (waiting for it): that round writes θ, v and the
        global step from the swarm's thread, so a checkpoint read meanwhile mixed two outer steps. Landing
        moves the parameters in place, so a model state_dict() taken just before holds them too."""
        if self._outer is not None and self._in_flight is not None:
            try:
                self._land_outer()
            except Interrupted:  # left as a failed round: its inner steps are in x, counted again
                pass
        state = {"optimizer": self.inner.state_dict(), "global_step": self.global_step}
        if self._outer is not None:  # θ_t and v; the parameters (x) are the model's to save
            state["outer_momentum"] = self._outer.momentum.detach().cpu().clone()
            state["outer_anchor"] = self._outer.anchor.detach().cpu().clone()
            state["inner_steps_taken"] = self._outer.inner  # since θ_t (x holds them)
        if self._local is not None:  # the base the next exchange measures progress from, and its version
            state["local_base"] = self._local.state.base.clone()
            state["local_steps"] = self._local_steps
        feedback = self._feedback()
        if feedback is not None:  # top-k: what this peer contributed and has not sent yet
            state["topk_residual"] = feedback.residual.detach().cpu().clone()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _feedback(self) -> Optional[ErrorFeedback]:
        """--compression topk: the error-feedback residual (diloco's, or lasgd's and gossip's)."""
        if self._outer is not None:
            return self._outer.feedback
        return self._local.feedback if self._local is not None else None

    def _load_residual(self, residual: Optional[torch.Tensor]) -> None:
        """A checkpoint's top-k residual, so a resumed peer still sends what it had not (one without it, from
        before top-k or an older phalanx, leaves the residual empty)."""
        feedback = self._feedback()
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
        self._swarm.call(self._load_state(state_dict))

    async def _load_state(self, state_dict: dict[str, Any]) -> None:
        """load_state_dict's work, on the node's loop while the caller's thread waits (the parameters hold still)."""
        step = int(state_dict["global_step"])
        self._load_residual(state_dict.get("topk_residual"))  # first: its size check changes nothing else
        self.inner.load_state_dict(state_dict["optimizer"])
        if self._local is not None:
            if "local_base" not in state_dict:
                raise ConfigError(f"phalanx.Optimizer.load_state_dict: a {self.plan.training.mode} checkpoint has local_base; this one has none")
            self._local.restore(state_dict["local_base"], step)
            self._local_steps = int(state_dict.get("local_steps", 0))
        if self._outer is not None:
            if "outer_momentum" not in state_dict:
                raise ConfigError(
                    "phalanx.Optimizer.load_state_dict: a diloco checkpoint has outer_momentum; this one has none"
                )
            # θ_t itself when saved (the parameters hold x, which may have moved on from it)
            self._outer.restore(state_dict["outer_momentum"], state_dict.get("outer_anchor"), step)
            if self._replay is not None:  # a verified phase starts at θ_t: its steps are replayed from there
                write_flat(self._outer.params, self._outer.anchor)
            else:
                self._outer.inner = int(state_dict.get("inner_steps_taken", 0))
        if self._local is not None:
            await self._local.publish()
        else:
            self.node.engine.set_state(initial_version(self.plan.run_hash, self._steps.state_tensors(), step), step)
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
        if self._in_flight is not None:  # diloco: a round still running is left (the others go on without us)
            self._in_flight.cancel()
        try:
            self._swarm.call(self._aclose())
        finally:
            self._swarm.close()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- inside ------------------------------------------------------------------------------

    async def _open(self) -> Node:
        self._stop = asyncio.Event()
        node = self.node = await open_node(self.plan, loss=lambda: self._last_loss)
        try:
            in_thread = lambda fn, *args: asyncio.get_running_loop().run_in_executor(None, fn, *args)  # noqa: E731
            if self.plan.training.mode in LOCAL_MODES:
                self._local = self._steps = LocalExchange(
                    node.engine, self.trainable, self.plan.exchange, lr=self._lr_max,
                    timeout_s=self.plan.round.allreduce_timeout_s, in_thread=in_thread,
                )  # fmt: skip
            elif self.plan.training.mode == "diloco":
                outer = self.plan.outer
                self._outer = self._steps = OuterStep(
                    node, self.trainable.params, inner_steps=outer.inner_steps, outer_lr=outer.outer_lr,
                    outer_momentum=outer.outer_momentum, in_thread=in_thread, overlap=outer.overlap == "on",
                    topk_fraction=outer.topk_fraction, recompute=self._replay_phase if self._replay is not None else None,
                    contribute=self.hooks.contribute,
                )  # fmt: skip
            else:
                self._steps = GlobalStep(
                    node, self.trainable, batch_size_per_step=self.batch_size_per_step,
                    target_batch_size=self.target_batch_size, wait_for_peers=self.plan.training.wait_for_peers,
                    in_thread=in_thread, recompute=self._recompute if self.plan.round.verify is not None else None,
                )  # fmt: skip
            if self._local is None:
                node.engine.set_state(initial_version(self.plan.run_hash, self._steps.state_tensors(), 0), 0)
            self._health = await open_node_health(node, self.plan, self.metrics)
            if self._initial_state is not None:
                await self._load_state(self._initial_state)
            opened = self.hooks.opened(self)
            if inspect.isawaitable(opened):
                await opened
            await wait_for_trainers(node, self.plan.training.wait_for_peers, self._stop)
            if self._stop.is_set():
                raise Interrupted("interrupted while waiting for the other trainers")
            if self._local is not None:  # like phalanx join: a newcomer starts from the swarm's model
                await self._join_late(node)
            elif self._outer is None:
                self._steps.share = self._steps.next_share()  # now that the trainers are in view
        except BaseException:
            await node.aclose()
            raise
        return node

    async def _aclose(self) -> None:
        if self._health is not None:
            await self._health.aclose()
        await self.node.aclose()

    def _global_step(self) -> None:
        """Average this peer's gradient with the swarm's (weighted by local steps) and step on it."""
        samples = self._steps.samples  # counted before the round: finishing it resets the count to 0
        self._landed(self._swarm.call(self._round()), samples)

    def _local_step(self) -> None:
        """lasgd/gossip: the wrapped optimizer steps on this batch's gradient; the exchange in flight is
        merged once it is done, and every sync_every steps a new one starts while the loop goes on."""
        local = self._local
        assert local is not None
        observe = local.correction.gap_aware is not None
        before = self.trainable.flat_params() if observe else None
        self.inner.step()
        if before is not None:  # Gap-Aware's statistic: the unpenalized step, in units of the largest lr
            step = (before - self.trainable.flat_params()) / self._lr_max
            if torch.isfinite(step).all():
                local.correction.observe(step)
        self._local_steps += 1
        self._since_exchange += 1
        if self._in_flight is not None and self._in_flight.done():
            self._land_local()
        if self._in_flight is None and self._since_exchange >= self.plan.exchange.sync_every:
            self._check_node()
            local.snapshot()
            self._since_exchange = 0
            self._in_flight = self._swarm.submit(self.node.engine.run_round(prepare=local.contribution))

    def _land_local(self) -> None:
        """Merge the finished exchange (this thread holds the parameters) and publish the new base."""
        local, future = self._local, self._in_flight
        assert local is not None and future is not None
        self._in_flight = None
        try:
            outcome = future.result()
        except ROUND_FAILURES as e:
            local.failed()
            self.metrics.round_failed()
            self._last_round = "failed"
            logger.info(f"exchange at version {local.version} failed: {e}; the next one starts in sync_every steps")
            return
        if not isinstance(outcome, Averaged):
            local.failed()
            return
        part = local.last
        if part is not None and part.reset_to is not None:  # too far behind: our progress is dropped
            logger.info(f"{part.penalty.gap_versions} versions behind (> max_gap): took the swarm's model")
            self.trainable.load_flat_params(part.reset_to)
            local.state.snapshot = part.reset_to.clone()
        elif part is not None and part.penalty.gap_versions > 0:
            penalty = part.penalty
            logger.info(
                f"stale contribution ({penalty.gap_versions} versions behind): "
                f"{penalty.method} divided it by {penalty.mean_divisor:.2f} on average"
            )
            self.metrics.staleness_penalty = penalty.mean_divisor
            self.hooks.event("penalty", gap=penalty.gap_versions, method=penalty.method, divisor=penalty.mean_divisor)
        local.merge(outcome)
        self._swarm.call(local.publish())
        self._landed(outcome, self.plan.exchange.sync_every * self.batch_size_per_step)

    async def _join_late(self, node: Node) -> bool:
        """lasgd/gossip: download the state of the peer furthest on and take it as ours (the caller's
        thread waits, so the parameters hold still); False when no peer is past version 0."""
        local = self._local
        assert local is not None
        peers = {p: r.step for p, r in node.membership.peers().items() if p != node.peer_id}
        try:
            found = await local.download(peers)
        except (PhalanxError, ValueError) as e:
            logger.warning(f"could not download the swarm's model: {e}; starting fresh")
            found = None
        if found is not None:
            snapshot, donor = found
            await asyncio.get_running_loop().run_in_executor(None, local.adopt, snapshot)
            logger.info(f"joined a running swarm: model of version {snapshot.step} from {donor[-8:]}")
            self._last_round = "resynced"
            self.hooks.event("resynced", donor=donor)
        await local.publish()
        return found is not None

    def _outer_boundary(self) -> None:
        """diloco: land the round in flight once it is over (a boundary waits for it), then begin the
        next one at a boundary; without overlap, wait for that one too. Failed rounds are retried after
        a back-off, their inner steps counted into the next Δ."""
        outer = self._outer
        assert outer is not None
        if self._in_flight is not None and (self._in_flight.done() or outer.inner >= outer.inner_steps):
            self._land_outer()
        while outer.inner >= outer.inner_steps and self._in_flight is None:
            if not outer.ready and self._interrupted.wait(outer.retry_in_s):  # a back-off after a failed round
                raise Interrupted("interrupted during the back-off after a failed outer round")
            self._check_node()
            delta = outer.begin()
            self._in_flight = self._swarm.submit(self._outer_round(delta))
            if outer.overlap:
                return
            self._land_outer()

    def _land_outer(self) -> None:
        """Apply the round in flight (waiting for it). One an interrupt left counts as failed (its inner
        steps go into the next Δ), and Interrupted raises."""
        outer, future = self._outer, self._in_flight
        assert outer is not None and future is not None
        self._in_flight = None
        try:
            outcome = future.result()
        except Interrupted:
            outer.failed()
            raise
        except ROUND_FAILURES as e:
            outer.failed()
            self.metrics.round_failed()
            self._last_round = "failed"
            logger.warning(f"outer round at global step {self.global_step} failed: {e}; retrying")
            return
        if outcome is None:  # the state download failed: another round
            outer.failed()
            return
        outer.rebase()
        self._landed(outcome, outer.inner_steps * self.batch_size_per_step)
        self._sit_out_next_phase(outcome)

    async def _outer_round(self, delta: torch.Tensor) -> Union[Averaged, Resync, None]:
        outer = self._outer
        assert outer is not None
        outcome = await self._unless_interrupted(outer.round(delta))
        return await asyncio.shield(outer.finish(outcome))  # θ and v change all at once or not at all

    def _landed(self, outcome: Union[Averaged, Resync], samples: int) -> None:
        if isinstance(outcome, Averaged):
            self._last_round = "partial" if outcome.result.missing_parts else "ok"
            self._peers_last_round = len(outcome.group.members)
            self.metrics.round_done(
                step=self.position, loss=self._last_loss if self._last_loss is not None else math.nan,
                samples=samples, averaged=outcome, duration_s=self.node.engine.stats.last_round_s,
            )  # fmt: skip
        else:
            self._last_round = "resynced"
            self.metrics.resync_started(outcome)
            self.metrics.resynced(self.position)
            self.hooks.event("resynced", donor=outcome.donor)

    async def _round(self) -> Union[Averaged, Resync]:
        """The round of this global step, retried (backing off) until one completes."""
        failures = 0
        while True:
            self._check_node()
            try:
                outcome = await self._unless_interrupted(self._steps.round())
                outcome = await asyncio.shield(self._steps.finish(outcome))  # never cancelled halfway
            except ROUND_FAILURES as e:
                failures += 1
                self.metrics.round_failed()
                self._last_round = "failed"
                logger.warning(f"round at global step {self.global_step} failed: {e}; retrying")
                await self._unless_interrupted(asyncio.sleep(min(5.0, 0.1 * 2 ** min(failures, 6))))
                continue
            if outcome is not None:
                return outcome

    async def _unless_interrupted(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`'s result; cancelled, raising Interrupted, if `interrupt()` comes first, unless its round
        has formed a group: the others count on this peer's part then (leaving mid-way hands them a
        partial round, each missing different parts), and the round's own deadlines bound the wait."""
        assert self._stop is not None
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done() and self.node.engine.in_group:
            await asyncio.wait({task})
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise Interrupted("interrupted while a round ran")
        return task.result()

    async def _recompute(self, peer_id: str) -> torch.Tensor:
        """A validator's honest recomputation of `peer_id`'s gradient at this round's parameters, on a
        copy of the model (the caller's thread waits for the round, so the model holds still)."""

        def run() -> torch.Tensor:
            if self._validator_model is None:
                self._validator_model = copy.deepcopy(self.model)
            self._validator_model.load_state_dict(self.model.state_dict())
            self._validator_model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                self.loss_fn(self._validator_model, self.batch_fn(self.seed, peer_id, self.global_step)).backward()
            copies = list(self._validator_model.parameters())
            params = [copies[self._model_index[id(p)]] for p in self.trainable.params]  # the optimizer's order
            return torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            ).cpu()

        return await asyncio.get_running_loop().run_in_executor(None, run)

    async def _replay_phase(self, peer_id: str) -> torch.Tensor:
        """A validator's replay of `peer_id`'s inner steps of this round's phase, from θ_t (the caller's
        thread waits for the round: strict diloco, so the model holds still)."""
        outer, replay = self._outer, self._replay
        assert outer is not None and replay is not None
        first = outer.step * outer.inner_steps
        if replay.ready is not None and replay.ready[:2] == (peer_id, first):  # replayed while sitting out
            return replay.ready[2].clone()
        return await asyncio.get_running_loop().run_in_executor(
            None, replay.delta, peer_id, first, outer.inner_steps, outer.anchor, outer.params
        )

    def _check_node(self) -> None:
        node = self.node
        if node.peer_id in node.membership.banned:
            raise PhalanxError("the swarm banned this peer (its ban votes are in the DHT); stopping")
        if not node.dht.is_alive():
            raise PhalanxError(f"{DHT_DIED}: the swarm is out of reach")

    def _follow_schedule(self) -> None:
        """Step the scheduler to the global step (diloco: to the inner step, H per outer step); a
        newcomer's catches up with the swarm's."""
        if self.scheduler is None:
            return
        position = self.position
        with warnings.catch_warnings():  # a newcomer's schedule catches up before its optimizer ever stepped
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before", category=UserWarning)
            while self._scheduled < position:
                self.scheduler.step()
                self._scheduled += 1


def _refuse_join_settings(settings: dict[str, Any]) -> None:
    """One line for the first setting only `phalanx join`'s loop uses (JOIN_ONLY, and its gradient
    attacks, which it applies to the gradients it computes): here it would do nothing."""
    for name, value in settings.items():
        if name in JOIN_ONLY:
            raise ConfigError(f"phalanx.Optimizer({name}={value!r}): only phalanx join uses it; {JOIN_ONLY[name]}")
        if name == "attack" and isinstance(value, str) and value.partition(":")[0] in GRADIENT_ATTACKS:
            raise ConfigError(
                f"phalanx.Optimizer(attack={value!r}): only phalanx join uses gradient attacks; change the "
                "gradients in your own loop before opt.step()"
            )


def _make_inner(optimizer: Any, params: Optional[Iterable[torch.Tensor]]) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        if params is not None:
            raise ConfigError(
                "phalanx.Optimizer: give params only with an optimizer factory; this optimizer has its own"
            )
        return optimizer
    if not callable(optimizer):
        raise ConfigError(
            f"phalanx.Optimizer(optimizer={type(optimizer).__name__}): give a torch.optim.Optimizer or a factory "
            "called with params (e.g. lambda params: torch.optim.AdamW(params, lr=3e-4))"
        )
    if params is None:
        raise ConfigError("phalanx.Optimizer: an optimizer factory needs params=model.parameters()")
    inner = optimizer(params)
    if not isinstance(inner, torch.optim.Optimizer):
        raise ConfigError(
            f"phalanx.Optimizer: the factory returned {type(inner).__name__}, not a torch.optim.Optimizer"
        )
    return inner


def _plan(
    inner: torch.optim.Optimizer,
    run_id: str,
    mode: str,
    batch_size: int,
    target: Optional[int],
    seed: int,
    verify: bool,
    settings: dict[str, Any],
) -> PeerPlan:
    """The plan of `phalanx join` for these settings; its task name fingerprints what peers must share
    that a task would have fixed: parameter shapes, the optimizer and its hyperparameters, the target."""
    fields = {**settings, "run_id": run_id, "mode": mode, "batch_size": batch_size, "seed": seed, "verify": verify}
    fields["task"] = _fingerprint(inner, target)
    ignored = environment_settings()
    if ignored:
        logger.warning(
            f"phalanx.Optimizer ignores {', '.join(ignored)}: PHALANX_* variables configure the phalanx command; "
            "give a script's settings as arguments"
        )
    try:
        config = settings_from_arguments(PeerConfig, fields)
    except ValidationError as e:
        first = e.errors()[0]
        message = _as_arguments(first["msg"].removeprefix("Value error, "))
        where = f"({first['loc'][0]}={first.get('input')!r})" if first["loc"] else ""  # a rule across settings
        unknown = first["type"] == "extra_forbidden"
        raise ConfigError(
            f"phalanx.Optimizer{where}: "
            + ("no such setting; settings are phalanx join's flags with underscores" if unknown else message)
        ) from None
    try:
        return make_plan(config)
    except ConfigError as e:
        raise ConfigError(f"phalanx.Optimizer: {_as_arguments(str(e))}") from None


def _fingerprint(inner: torch.optim.Optimizer, target: Optional[int]) -> str:
    groups = []
    for g in inner.param_groups:
        shapes = [[list(p.shape), str(p.dtype)] for p in g["params"]]
        hyper = {
            k: (v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
            for k, v in g.items()
            if k != "params"
        }
        groups.append({"shapes": shapes, "hyper": hyper})
    spec = {"optimizer": type(inner).__qualname__, "groups": groups, "target_batch_size": target}
    return "phalanx.Optimizer:" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _as_arguments(message: str) -> str:
    """phalanx join's error messages name flags; here they name the arguments (`--tau` → `tau=`)."""
    return re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_") + "=", message)


def _check_local_settings(mode: str, target: Optional[int], settings: dict[str, Any]) -> None:
    """What lasgd/gossip take in phalanx join but not here: the loop computes its own gradients, so
    there is no look-ahead point to compute them at, and the wrapped optimizer's state is its own."""
    if target is not None:
        raise ConfigError(
            f"phalanx.Optimizer(mode={mode!r}, target_batch_size=...): {mode} exchanges every sync_every local steps "
            "and never waits for a global batch; drop target_batch_size and set sync_every"
        )
    if settings.get("dana"):
        raise ConfigError(
            f"phalanx.Optimizer(mode={mode!r}, dana=True): DANA computes gradients at a look-ahead point your loop "
            "does not know of; drop dana (or use `phalanx join --mode lasgd --dana` with a task)"
        )
    if settings.get("average_optimizer_state"):
        raise ConfigError(
            f"phalanx.Optimizer(mode={mode!r}, average_optimizer_state=True): the wrapped optimizer's state stays "
            "local here; drop average_optimizer_state (or use `phalanx join --mode lasgd` with SGD)"
        )
