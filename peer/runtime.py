"""What every training mode shares: model and optimizer, the worker thread, events and the report,
the eval/checkpoint cadence, stopping, and failure accounting. A mode (peer/modes/) is a loop over
this public interface; the runtime opens the node, runs the mode, and closes everything after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, TypeVar

import torch

from phalanx.aggregation.errors import ConfigError, PhalanxError
from phalanx.aggregation.spec import parse_params
from phalanx.peer.checkpoint import Checkpoint, load_latest, save_checkpoint
from phalanx.peer.health import PeerMetrics, open_node_health
from phalanx.peer.model import Model, resolve_device
from phalanx.peer.node import DHT_DIED, Node, open_node, visible_maddrs, wait_for_trainers
from phalanx.peer.plan import PeerPlan, TrainingConfig
from phalanx.protocol.engine import RoundEngine, initial_version
from phalanx.tasks import compute_gradient, resolve_task

logger = logging.getLogger(__name__)

T = TypeVar("T")
EVENT_EVERY_S = 0.5  # step events at most this often (a fast peer would flood stdout)
LOG_EVERY = 50  # steps between progress lines in the log


@dataclass
class Report:
    peer_id: str = ""
    step: int = 0
    loss: Optional[float] = None
    accuracy: Optional[float] = None
    rounds_ok: int = 0
    rounds_partial: int = 0
    rounds_failed: int = 0
    resyncs: int = 0
    group_size: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float = 0.0
    reached_target: bool = False
    param_hash: str = ""
    banned: list[str] = field(default_factory=list)  # peers this one saw banned
    attack: Optional[str] = None
    peak_rss_bytes: int = 0  # this process's peak resident memory (not its DHT process or p2pd)


class Mode(Protocol):
    """A training loop (peer/modes/), built by `Runtime.run` once the node is open."""

    @property
    def step(self) -> int:
        """The steps this peer took: what the report says and the eval/checkpoint cadence counts."""
        ...

    async def run(self) -> None:
        """Train until `runtime.done(step)` or `runtime.check_node()` says stop."""
        ...


class Runtime:
    """One per peer process. Modes call only its public members; `run` owns the node's lifetime."""

    def __init__(self, plan: PeerPlan) -> None:
        self.plan, self.config = plan, plan.training
        config = plan.training
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.device = resolve_device(config.device)
        self.task = resolve_task(config.task, **task_options(config)).to(self.device)
        self.model = Model(self.task, config)
        self.batch_size = config.batch_size or self.task.batch_size
        self.attack = plan.attack.gradient
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train")
        self.report = Report()
        self.health = PeerMetrics(role="trainer")  # updated once per round; read by the health server
        self.stop_requested = asyncio.Event()
        # what --eval-every evaluates (worker thread): the model, unless the mode says otherwise
        self.evaluated_module: Callable[[], torch.nn.Module] = lambda: self.model.module
        # what a checkpoint holds besides the model and its optimizer: the mode's own state (diloco: θ_t, v)
        self.checkpoint_extra: Callable[[], dict[str, Any]] = dict
        self.resumed: Optional[Checkpoint] = None  # the checkpoint --resume loaded, for the mode's own state
        self._last_event = 0.0
        self._node: Optional[Node] = None

    @property
    def opened(self) -> bool:
        """Whether the node is up (its DHT started and answered)."""
        return self._node is not None

    @property
    def node(self) -> Node:
        if self._node is None:
            raise RuntimeError("the node opens in Runtime.run, before the mode is built")
        return self._node

    @property
    def engine(self) -> RoundEngine:
        return self.node.engine

    # ---- the worker thread, events --------------------------------------------------------------

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the one training thread: model access never races, the event loop never blocks."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def emit(self, event: str, **fields: Any) -> None:
        """One JSON line on stdout with --events (what the swarm launcher and tests read)."""
        if self.config.events:
            sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            sys.stdout.flush()

    # ---- gradients (worker thread) ------------------------------------------------------------

    def contribution(self, step: int) -> tuple[float, torch.Tensor]:
        """This step's gradient on our public batch — or, with --attack, what the attacker sends instead."""
        peer_id = self.node.peer_id
        flip = self.attack is not None and self.attack.flips_labels
        loss, grad = self.gradient(self.model.module, peer_id, step, flip_labels=flip)
        if self.attack is not None:
            extra = lambda k: self.gradient(self.model.module, f"{peer_id}/extra{k}", step)[1]  # noqa: E731
            grad = self.attack.contribution(step, grad, extra)
        return loss, grad

    def gradient(self, module, peer_id: str, step: int, *, flip_labels: bool = False) -> tuple[float, torch.Tensor]:
        """`peer_id`'s honest gradient of `step` at `module`'s parameters (anyone can recompute it)."""
        if not flip_labels:
            return compute_gradient(self.task, module, self.config.seed, peer_id, step, self.batch_size)
        module.zero_grad(set_to_none=True)
        inputs, targets = self.task.batch(self.config.seed, peer_id, step, self.batch_size)
        classes = int(self.task.train_targets.max()) + 1
        loss = self.task.loss(module, inputs, classes - 1 - targets)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
        return loss.item(), torch.nn.utils.parameters_to_vector(grads)

    # ---- stopping -----------------------------------------------------------------------------

    def done(self, step: int) -> bool:
        """A stop was requested, --steps are taken or --target-accuracy (--target-loss) is reached."""
        if self.stop_requested.is_set():
            return True
        if self.config.steps is not None and step >= self.config.steps:
            return True
        return self.report.reached_target

    async def check_node(self) -> bool:
        """False when a stop was requested; raises (the final checkpoint is still written) rather
        than train on alone when the swarm is out of reach."""
        node = self.node
        if node.peer_id in node.membership.banned:
            raise PhalanxError("the swarm banned this peer (its ban votes are in the DHT and the log); stopping")
        if not node.dht.is_alive():
            await self.sleep_or_stop(2.0)  # a signal to the process group stops the DHT too: let ours arrive
            if not self.stop_requested.is_set():
                raise PhalanxError(f"{DHT_DIED}: the swarm is out of reach; stopping")
        return not self.stop_requested.is_set()

    async def run_unless_stopped(self, coro: Awaitable[T]) -> Optional[asyncio.Future[T]]:
        """Run `coro` until it finishes (its finished future) or a stop is requested (it is cancelled: None)."""
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            return task
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None

    async def sleep_or_stop(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop_requested.wait(), timeout=seconds)
        except TimeoutError:
            pass

    # ---- per step and per round ---------------------------------------------------------------

    async def step_done(self, step: int, loss: float, detail: str, **event: Any) -> None:
        """After every step: the report, a step event and log line now and then, eval and checkpoint
        when their cadence says. `detail` ends the log line; `event` adds to the step event."""
        self.report.loss = loss
        now = time.monotonic()
        if now - self._last_event >= EVENT_EVERY_S:
            self._last_event = now
            self.emit("step", step=step, loss=loss, **event, bytes_sent=self.node.transport.stats.bytes_sent)
        if step % LOG_EVERY == 0:
            logger.info(f"step {step} loss {loss:.4f} {detail}")
        config = self.config
        if step % config.eval_every == 0 or (config.steps is not None and step >= config.steps):
            await self.evaluate(step)
        if config.checkpoint_dir is not None and step % config.checkpoint_every == 0:
            await self.in_thread(self.checkpoint, step)

    def round_failed(self, error: PhalanxError, what: str, *, level: int = logging.INFO) -> None:
        """A round raised (timeout, abort, misbehaving peer): the engine counted it; health and the log learn it."""
        self.health.round_failed()
        logger.log(level, f"{what} failed: {error}")

    async def evaluate(self, step: int) -> None:
        metrics = await self.in_thread(lambda: self.task.evaluate(self.evaluated_module()))
        self.report.accuracy = metrics["accuracy"]
        self.health.evaluated(metrics["accuracy"])
        extra = f" perplexity {metrics['perplexity']:.2f}" if "perplexity" in metrics else ""
        logger.info(f"step {step} test accuracy {metrics['accuracy']:.4f} loss {metrics['loss']:.4f}{extra}")
        self.emit("eval", step=step, **metrics)
        config = self.config
        if config.target_accuracy is not None and metrics["accuracy"] >= config.target_accuracy:
            self.report.reached_target = True
        if config.target_loss is not None and metrics["loss"] <= config.target_loss:
            self.report.reached_target = True

    def checkpoint(self, step: int) -> Optional[Path]:
        """Write a checkpoint of `step` (worker thread); None without --checkpoint-dir."""
        if self.config.checkpoint_dir is None:
            return None
        return save_checkpoint(
            self.config.checkpoint_dir,
            step=step,
            model_state=self.model.module.state_dict(),
            optimizer_state=self.model.optimizer.state_dict(),
            extra={"task": self.config.task, "run_id": self.plan.network.run_id, **self.checkpoint_extra()},
            keep=self.config.checkpoint_keep,
        )

    # ---- the run ------------------------------------------------------------------------------

    async def run(self, make_mode: Callable[[Runtime], Mode]) -> Report:
        """Open the node, wait for peers, run the mode, then report, checkpoint and close."""
        started = time.monotonic()
        step = await self.in_thread(self._resume)
        node = self._node = await open_node(self.plan, loss=lambda: self.report.loss)
        self.report.peer_id = node.peer_id
        engine = node.engine
        engine.set_state(initial_version(self.plan.run_hash, self.model.state_tensors(), step), step)
        logger.info(
            f"peer {node.peer_id} training {self.config.task} on {self.device} "
            f"({self.model.numel} parameters, step {step})"
        )
        if not self.plan.network.initial_peers:
            from phalanx.peer.bootstrap import initial_peers_line

            logger.info(f"others join this new swarm with: {initial_peers_line(await visible_maddrs(node.dht))}")
        param_hash = self.model.param_hash()
        self.emit("started", peer_id=node.peer_id, step=step, params=self.model.numel, param_hash=param_hash)
        health = None
        mode: Optional[Mode] = None
        try:
            health = await open_node_health(node, self.plan, self.health)
            await wait_for_trainers(node, self.config.wait_for_peers, self.stop_requested)
            self.emit("training", step=engine.step, peers=len(node.membership.peers()))
            mode = make_mode(self)
            await mode.run()
        finally:
            self.report.step = engine.step if mode is None else mode.step
            self.report.wall_s = time.monotonic() - started
            self.report.param_hash = await self.in_thread(self.model.param_hash)
            s = engine.stats
            self.report.rounds_ok, self.report.rounds_partial = s.rounds_ok, s.rounds_partial
            self.report.rounds_failed, self.report.resyncs = s.rounds_failed, s.resyncs
            self.report.banned = sorted(node.membership.banned)
            self.report.attack = self.plan.attack.name
            self.report.bytes_sent = node.transport.stats.bytes_sent
            self.report.bytes_received = node.transport.stats.bytes_received
            self.report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if self.config.checkpoint_dir is not None and self.report.step > 0:  # counted as --checkpoint-every counts
                path = await self.in_thread(self.checkpoint, self.report.step)
                logger.info(f"checkpoint saved: {path} (step {self.report.step}); continue with --resume")
            if health is not None:
                await health.aclose()
            await node.aclose()
            self.executor.shutdown(wait=True)
            self.emit("done", **asdict(self.report))
        return self.report

    def _resume(self) -> int:
        if not self.config.resume:
            return 0
        ckpt = load_latest(self.config.checkpoint_dir)
        if ckpt is None:
            logger.info(f"no checkpoint in {self.config.checkpoint_dir}; starting from scratch")
            return 0
        self.model.module.load_state_dict(ckpt.model_state, strict=True)
        self.model.optimizer.load_state_dict(ckpt.optimizer_state)
        self.resumed = ckpt
        logger.info(f"resumed from {ckpt.path.name} at step {ckpt.step}")
        return ckpt.step


def task_options(config: TrainingConfig) -> dict[str, Any]:
    """The task factory's keyword arguments: --data-dir, --data-file and --task-options name=value pairs."""
    options: dict[str, Any] = dict(parse_params(config.task_options))
    for name in ("data_dir", "data_file"):
        if getattr(config, name) is not None:
            if name in options:
                raise ConfigError(f"--task-options {name}= and --{name.replace('_', '-')} both give it: keep one")
            options[name] = getattr(config, name)
    return options
