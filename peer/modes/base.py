"""What a mode is to `phalanx.Optimizer` (peer/optimizer.py), and what it reaches the swarm through.

The optimizer keeps the swarm's thread, its lifecycle, `interrupt()` and the LR scheduler; a `Mode`
decides what a local step does (and when it waits for a round), the position the schedule follows,
its part of the statistics and of the state dict, and how a newcomer takes the swarm's state. Modes
never see the optimizer: they get a `Swarm`, which holds what both share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar, Union

import torch

from phalanx.aggregation.compression import ErrorFeedback
from phalanx.errors import ConfigError, PhalanxError
from phalanx.peer.health import PeerMetrics
from phalanx.peer.model import Trainable
from phalanx.peer.node import DHT_DIED, Node
from phalanx.peer.node_loop import SwarmLoop
from phalanx.peer.plan import PeerPlan
from phalanx.protocol.engine import Averaged, Resync, initial_version

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Interrupted(PhalanxError):
    """`step()` (or the constructor's wait) gave up because `interrupt()` was called."""


@dataclass
class JoinHooks:
    """What `phalanx join`'s loop adds to the optimizer (library users leave it empty)."""

    opened: Callable[[Any], Any] = lambda optimizer: None
    """Called with the optimizer (on the node's loop; it may return an awaitable) once the node is up and
    holds the state it starts from, before waiting for the other trainers."""
    contribute: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None
    """diloco: (outer step, honest Δ) → what this peer sends instead (`--attack`)."""
    event: Callable[..., None] = lambda name, **fields: None
    """Called with "resynced" (donor=), "penalty" (gap=, method=, divisor=) and diloco's "outer" (outer_step=,
    group=, round_s=), as they happen."""
    metrics: Optional[PeerMetrics] = None
    """The health server's metrics, when the caller shows them too."""


@dataclass
class PublicBatches:
    """Verified runs: how anyone recomputes a peer's step, `loss_fn(model, batch_fn(seed, peer_id, step))`."""

    model: torch.nn.Module
    batch_fn: Callable[[int, str, int], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    seed: int


@dataclass
class ModeStatistics:
    """A mode's part of `phalanx.Optimizer.statistics()`."""

    local_samples: int
    samples_per_round: int
    staleness_penalty: Optional[float] = None


@dataclass
class Swarm:
    """This peer in its swarm, as the optimizer and its mode share it: the plan, the parameters, the node
    on its loop's thread, the interrupt, and what the last round did."""

    plan: PeerPlan
    trainable: Trainable
    hooks: JoinHooks
    metrics: PeerMetrics
    loop: SwarmLoop
    batch_size_per_step: int
    target_batch_size: Optional[int] = None
    public: Optional[PublicBatches] = None
    node: Node = field(init=False)
    interrupted: threading.Event = field(default_factory=threading.Event)
    stop: Optional[asyncio.Event] = None  # `interrupted` on the swarm's loop (set there by interrupt())
    last_loss: Optional[float] = None
    last_round: Optional[str] = None
    peers_last_round: int = 0

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self.trainable.optimizer

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.call(coro)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self.loop.submit(coro)

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def unless_interrupted(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self.stop is not None
        return await unless_interrupted(coro, self.stop, self.node)

    def check_node(self) -> None:
        node = self.node
        if node.peer_id in node.membership.banned:
            raise PhalanxError("the swarm banned this peer (its ban votes are in the DHT); stopping")
        if not node.dht.is_alive():
            raise PhalanxError(f"{DHT_DIED}: the swarm is out of reach")

    def round_failed(self) -> None:
        self.metrics.round_failed()
        self.last_round = "failed"

    def landed(self, outcome: Union[Averaged, Resync], samples: int, position: int) -> None:
        """Record a round the mode applied (or the resync it turned into)."""
        if isinstance(outcome, Averaged):
            self.last_round = "partial" if outcome.result.missing_parts else "ok"
            self.peers_last_round = len(outcome.group.members)
            self.metrics.round_done(
                step=position, loss=self.last_loss if self.last_loss is not None else math.nan,
                samples=samples, averaged=outcome, duration_s=self.node.snapshot().last_round_s,
            )  # fmt: skip
        else:
            self.last_round = "resynced"
            self.metrics.resync_started(outcome)
            self.metrics.resynced(position)
            self.hooks.event("resynced", donor=outcome.donor)


async def unless_interrupted(coro: Coroutine[Any, Any, T], stop: asyncio.Event, node: Any) -> T:
    """`coro`'s result; cancelled, raising Interrupted, if `stop` is set first, unless its round has formed
    a group: the others count on this peer's part then (leaving mid-way hands them a partial round, each
    missing different parts), and the round's own deadlines bound the wait."""
    task = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done() and node.engine.in_group:
        await asyncio.wait({task})
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Interrupted("interrupted while a round ran")
    return task.result()


def model_index(model: torch.nn.Module, params: list[torch.Tensor]) -> dict[int, int]:
    """id(parameter) → its index in `model.parameters()`: recomputations on a copy of the model find the
    optimizer's parameters there."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    if any(id(p) not in index for p in params):
        raise ConfigError(
            "phalanx.Optimizer(verify=True, model=...): the model must hold every parameter the optimizer steps"
        )
    return index


class Mode(ABC):
    """One training mode inside `phalanx.Optimizer`: built before the node opens, given it in `open()`."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm

    @classmethod
    def check_settings(cls, name: str, target_batch_size: Optional[int], settings: dict[str, Any]) -> None:
        """The library refuses settings that `phalanx join` takes with this mode but a user's loop cannot."""
        return None

    @abstractmethod
    async def open(self) -> None:
        """Build on `swarm.node` (now up) and announce the state this peer starts from."""

    async def joined(self) -> None:
        """The other trainers are in view (or none were waited for)."""
        return None

    @abstractmethod
    def step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """A local step on the caller's thread, and the rounds it starts or lands; the closure's loss."""

    @property
    @abstractmethod
    def position(self) -> int:
        """Steps of this peer's schedule: what LR schedulers and public batches follow."""

    @abstractmethod
    def statistics(self) -> ModeStatistics: ...

    def state_dict(self) -> dict[str, Any]:
        """The mode's part of a checkpoint, beside the wrapped optimizer's state and the global step."""
        return {}

    @abstractmethod
    async def load_state(self, state: dict[str, Any], step: int) -> None:
        """A checkpoint's part of the mode, on the node's loop (the caller's thread waits); announce it."""

    @abstractmethod
    def load_state_from_peers(self) -> bool:
        """Take the swarm's state (a newcomer); False when no peer handed one over."""

    @property
    def feedback(self) -> Optional[ErrorFeedback]:
        """--compression topk: what this peer contributed and has not sent yet."""
        return None

    @property
    def validating(self) -> Optional[str]:
        """The member whose work this peer replays instead of training its own, if any."""
        return None

    @property
    def round_in_flight(self) -> bool:
        """A round started at a boundary runs in the background."""
        return False

    @property
    def settled(self) -> bool:
        """Whether `state_dict()` and `shared_parameters()` hold now without waiting for a round in flight
        (diloco's lands θ_t, v and the global step all at once): checkpoints and evaluations wait until so."""
        return True

    def shared_parameters(self) -> Optional[torch.Tensor]:
        """The parameters every peer holds alike, when the model's are this peer's own (diloco's θ_t):
        what an evaluation of the swarm's model measures. None: the model's parameters are the swarm's."""
        return None

    def flush(self) -> None:
        """Land what runs in the background (the end of a run)."""
        return None

    def close(self) -> None:
        """Leave what runs in the background (the others go on without this peer)."""
        return None


class LockstepMode(Mode):
    """A mode whose state (`steps`: parameters and what else every peer shares) has a version the swarm
    agrees on, so a newcomer downloads it whole."""

    steps: Any  # state_tensors() and load_state_tensors()

    def announce(self, step: int) -> None:
        engine = self.swarm.node.engine
        engine.set_state(initial_version(self.swarm.plan.run_hash, self.steps.state_tensors(), step), step)

    def load_state_from_peers(self) -> bool:
        engine = self.swarm.node.engine
        snapshot = self.swarm.call(engine.fetch_swarm_state(self.steps.state_tensors()))
        if snapshot is None:
            return False
        engine.set_state(snapshot.version, snapshot.step)
        self.steps.load_state_tensors(snapshot.tensors)
        self.swarm.last_round = "resynced"
        return True


def call_closure(closure: Optional[Callable[[], Any]]) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
