"""The training loop of `phalanx join` in sync mode: one all-reduced gradient per step.

    compute gradient on (seed, peer, step)'s batch   (worker thread)
    round: matchmaking + butterfly all-reduce        (event loop)
    apply the aggregate with the optimizer            (worker thread, never cancelled)
    evaluate / checkpoint / report every N steps

A peer that the leader finds out of sync downloads a donor's state instead of applying.
SIGINT/SIGTERM stop the loop between steps and write a final checkpoint; SIGUSR1 logs what
every asyncio task and thread is doing (for a peer that seems stuck).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from phalanx.aggregation.errors import ConfigError, PeerProtocolError, PhalanxError, RoundAbortedError, RoundTimeoutError
from phalanx.peer.checkpoint import load_latest, save_checkpoint
from phalanx.peer.health import PeerMetrics, open_node_health
from phalanx.peer.node import DHT_DIED, Node, open_node, quiet_p2p_daemon_noise, visible_maddrs
from phalanx.peer.plan import PeerPlan, TrainingConfig
from phalanx.tasks import Task, compute_gradient, resolve_task
from phalanx.protocol.engine import Resync, initial_version

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: this machine has no CUDA GPU visible to torch; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


class Model:
    """The model, its optimizer and the conversions the protocol needs (flat grads, named state)."""

    def __init__(self, task: Task, config: TrainingConfig) -> None:
        self.task = task
        self.module = task.build_model(config.seed)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = task.make_optimizer(self.params, config.lr, config.momentum, config.weight_decay)
        self._materialize_optimizer_state()
        self.numel = sum(p.numel() for p in self.params)

    def _materialize_optimizer_state(self) -> None:
        """Create every optimizer buffer now (a zero-gradient step at lr=0), so the state layout a
        newcomer expects is the same as the one a trained peer sends."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.module.zero_grad(set_to_none=True)

    def apply(self, aggregate: torch.Tensor) -> None:
        """Use the group's aggregate (numel,) as this step's gradient."""
        aggregate = aggregate.to(self.params[0].device, non_blocking=True)
        offset = 0
        for p in self.params:
            p.grad = aggregate[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        self.module.zero_grad(set_to_none=True)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Named CPU copies of everything a newcomer needs: parameters, buffers, optimizer state."""
        tensors = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        for i, p in enumerate(self.params):
            for key, value in sorted(self.optimizer.state[p].items()):
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{i}.{key}"] = value.detach().to("cpu", copy=True)
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        model_state = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
        self.module.load_state_dict(model_state, strict=True)
        for i, p in enumerate(self.params):
            for key, value in self.optimizer.state[p].items():
                if isinstance(value, torch.Tensor):
                    value.copy_(tensors[f"optim.{i}.{key}"])

    def param_hash(self) -> str:
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]


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


class Trainer:
    def __init__(self, plan: PeerPlan) -> None:
        self.plan, self.config = plan, plan.training
        config = plan.training
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.device = resolve_device(config.device)
        options = {"data_dir": config.data_dir} if config.data_dir is not None else {}
        self.task = resolve_task(config.task, **options).to(self.device)
        self.model = Model(self.task, config)
        self.batch_size = config.batch_size or self.task.batch_size
        self.attack = plan.attack.gradient
        self._validator_model: Optional[torch.nn.Module] = None  # a copy: recomputation must not touch BatchNorm stats
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train")
        self.report = Report()
        self.health = PeerMetrics(role="trainer")  # updated once per round; read by the health server
        self.stop_requested = asyncio.Event()
        self._last_event = 0.0
        self._node: Optional[Node] = None

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.config.events:
            sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            sys.stdout.flush()

    def _resume(self) -> int:
        if not self.config.resume:
            return 0
        ckpt = load_latest(self.config.checkpoint_dir)
        if ckpt is None:
            logger.info(f"no checkpoint in {self.config.checkpoint_dir}; starting from scratch")
            return 0
        self.model.module.load_state_dict(ckpt.model_state, strict=True)
        self.model.optimizer.load_state_dict(ckpt.optimizer_state)
        logger.info(f"resumed from {ckpt.path.name} at step {ckpt.step}")
        return ckpt.step

    def _checkpoint(self, step: int) -> Optional[Path]:
        if self.config.checkpoint_dir is None:
            return None
        return save_checkpoint(
            self.config.checkpoint_dir,
            step=step,
            model_state=self.model.module.state_dict(),
            optimizer_state=self.model.optimizer.state_dict(),
            extra={"task": self.config.task, "run_id": self.plan.network.run_id},
            keep=self.config.checkpoint_keep,
        )

    async def run(self) -> Report:
        started = time.monotonic()
        step = await self._in_thread(self._resume)
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
        self._emit("started", peer_id=node.peer_id, step=step, params=self.model.numel, param_hash=self.model.param_hash())
        health = None
        try:
            health = await open_node_health(node, self.plan, self.health)
            await self._wait_for_peers(node)
            self._emit("training", step=node.engine.step, peers=len(node.membership.peers()))
            if self.config.mode == "sync":
                await self._loop(node)
            else:
                from phalanx.peer.local_loop import LocalLoop

                self._local = LocalLoop(self, node)
                await self._local.run()
        finally:
            local = getattr(self, "_local", None)
            self.report.step = engine.step if local is None else local.local_step
            self.report.wall_s = time.monotonic() - started
            self.report.param_hash = await self._in_thread(self.model.param_hash)
            s = engine.stats
            self.report.rounds_ok, self.report.rounds_partial, self.report.rounds_failed = s.rounds_ok, s.rounds_partial, s.rounds_failed
            self.report.resyncs = s.resyncs
            self.report.banned = sorted(node.membership.banned)
            self.report.attack = self.plan.attack.name
            self.report.bytes_sent = node.transport.stats.bytes_sent
            self.report.bytes_received = node.transport.stats.bytes_received
            if self.config.checkpoint_dir is not None and engine.step > 0:
                path = await self._in_thread(self._checkpoint, engine.step)
                logger.info(f"checkpoint saved: {path} (step {engine.step}); continue with --resume")
            if health is not None:
                await health.aclose()
            await node.aclose()
            self.executor.shutdown(wait=True)
            self._emit("done", **asdict(self.report))
        return self.report

    def _contribution(self, peer_id: str, step: int) -> tuple[float, torch.Tensor]:
        """This step's gradient on our public batch — or, with --attack, what the attacker sends instead."""
        flip = self.attack is not None and self.attack.flips_labels
        loss, grad = self._gradient(self.model.module, peer_id, step, flip_labels=flip)
        if self.attack is not None:
            extra = lambda k: self._gradient(self.model.module, f"{peer_id}/extra{k}", step)[1]  # noqa: E731
            grad = self.attack.contribution(step, grad, extra)
        return loss, grad

    def _gradient(self, module, peer_id: str, step: int, *, flip_labels: bool = False) -> tuple[float, torch.Tensor]:
        if not flip_labels:
            return compute_gradient(self.task, module, self.config.seed, peer_id, step, self.batch_size)
        module.zero_grad(set_to_none=True)
        inputs, targets = self.task.batch(self.config.seed, peer_id, step, self.batch_size)
        classes = int(self.task.train_targets.max()) + 1
        loss = self.task.loss(module, inputs, classes - 1 - targets)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
        return loss.item(), torch.nn.utils.parameters_to_vector(grads)

    async def _recompute(self, peer_id: str) -> torch.Tensor:
        """A validator's honest recomputation of `peer_id`'s gradient at this round's parameters."""

        def run() -> torch.Tensor:
            if self._validator_model is None:
                self._validator_model = copy.deepcopy(self.model.module)
            self._validator_model.load_state_dict(self.model.module.state_dict())
            return self._gradient(self._validator_model, peer_id, self._node.engine.step)[1].cpu()

        return await self._in_thread(run)

    async def _wait_for_peers(self, node: Node) -> None:
        deadline = time.monotonic() + 60.0
        while len(node.membership.peers()) < self.config.wait_for_peers and time.monotonic() < deadline:
            if self.stop_requested.is_set():
                return
            await asyncio.sleep(0.2)
            await node.membership.refresh()
        seen = len(node.membership.peers())
        if seen < self.config.wait_for_peers:
            logger.warning(f"starting with {seen} of the {self.config.wait_for_peers} peers asked for by --wait-for-peers")

    async def check_node(self, node: Node) -> bool:
        """False when a stop was requested; raises (the final checkpoint is still written) rather
        than train on alone when the swarm is out of reach."""
        if node.peer_id in node.membership.banned:
            raise PhalanxError("the swarm banned this peer (its ban votes are in the DHT and the log); stopping")
        if not node.dht.is_alive():
            await self._sleep_or_stop(2.0)  # a signal to the process group stops the DHT too: let ours arrive
            if not self.stop_requested.is_set():
                raise PhalanxError(f"{DHT_DIED}: the swarm is out of reach; stopping")
        return not self.stop_requested.is_set()

    def _done(self, step: int) -> bool:
        if self.stop_requested.is_set():
            return True
        if self.config.steps is not None and step >= self.config.steps:
            return True
        return self.report.reached_target

    async def run_unless_stopped(self, coro) -> Optional[asyncio.Future]:
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

    async def _sleep_or_stop(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop_requested.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def _loop(self, node: Node) -> None:
        engine, config = node.engine, self.config
        failures = 0
        while not self._done(engine.step) and await self.check_node(node):
            step = engine.step
            loss, grad = await self._in_thread(self._contribution, node.peer_id, step)
            round_task = await self.run_unless_stopped(engine.run_round(grad.to("cpu"), recompute=self._recompute))
            if round_task is None:
                break
            try:
                outcome = round_task.result()
            except (RoundAbortedError, RoundTimeoutError, PeerProtocolError) as e:
                engine.stats.rounds_failed += 1
                self.health.round_failed()
                failures += 1
                logger.warning(f"round at step {step} failed: {e}")
                # back off, so a peer the swarm refuses does not spin: 0.1 s, doubling up to 5 s
                await self._sleep_or_stop(min(5.0, 0.1 * 2 ** min(failures, 6)))
                continue
            failures = 0
            if isinstance(outcome, Resync):
                await self._resync(engine, outcome)
                continue
            # applying is never cancelled halfway: the model is either before or after this step
            await asyncio.shield(self._in_thread(self.model.apply, outcome.result.vector))
            await engine.completed(outcome, self.model.state_tensors)
            self.report.loss = loss
            self.report.group_size = len(outcome.group.members)
            self._after_step(engine.step, loss, outcome)
            if engine.step % config.eval_every == 0 or (config.steps is not None and engine.step >= config.steps):
                await self._evaluate(engine.step)
            if config.checkpoint_dir is not None and engine.step % config.checkpoint_every == 0:
                await self._in_thread(self._checkpoint, engine.step)

    async def _resync(self, engine, resync: Resync) -> None:
        self.health.resync_started(resync)
        try:
            snapshot = await engine.fetch_state(resync, self.model.state_tensors())
        except (PhalanxError, ValueError) as e:
            logger.warning(f"state download from {resync.donor[-8:]} failed: {e}")
            return
        await self._in_thread(self.model.load_state_tensors, snapshot.tensors)
        engine.set_state(snapshot.version, snapshot.step)
        self.health.resynced(snapshot.step)
        logger.info(f"loaded state of step {snapshot.step} from {resync.donor[-8:]}")
        self._emit("resynced", step=snapshot.step, donor=resync.donor)

    def _after_step(self, step: int, loss: float, outcome) -> None:
        result = outcome.result
        self.health.round_done(step=step, loss=loss, samples=self.batch_size, averaged=outcome, duration_s=self._node.engine.stats.last_round_s)
        now = time.monotonic()
        if now - self._last_event >= 0.5:
            self._last_event = now
            self._emit(
                "step",
                step=step,
                loss=loss,
                group=len(outcome.group.members),
                k=outcome.group.k,
                round_s=round(result.duration_s, 4),
                bytes_sent=self._bytes_sent(),
                missing_parts=len(result.missing_parts),
            )
        if step % 50 == 0:
            logger.info(
                f"step {step} loss {loss:.4f} group {len(outcome.group.members)} "
                f"round {result.duration_s * 1e3:.1f} ms sent {result.bytes_sent / 1e6:.2f} MB"
            )

    def _local_progress(self, step: int, loss: float, engine) -> None:
        """Progress of an asynchronous-mode peer: a step event every half second, a log line every 50 steps."""
        now = time.monotonic()
        if now - self._last_event >= 0.5:
            self._last_event = now
            self._emit("step", step=step, loss=loss, group=engine.stats.last_group_size, bytes_sent=self._bytes_sent())
        if step % 50 == 0:
            logger.info(f"step {step} loss {loss:.4f} (version {engine.step})")

    def _bytes_sent(self) -> int:
        return self._node.transport.stats.bytes_sent if self._node is not None else 0

    async def _evaluate(self, step: int) -> None:
        metrics = await self._in_thread(self.task.evaluate, self.model.module)
        self.report.accuracy = metrics["accuracy"]
        self.health.evaluated(metrics["accuracy"])
        logger.info(f"step {step} test accuracy {metrics['accuracy']:.4f} loss {metrics['loss']:.4f}")
        self._emit("eval", step=step, **metrics)
        if self.config.target_accuracy is not None and metrics["accuracy"] >= self.config.target_accuracy:
            self.report.reached_target = True


def dump_stacks() -> None:
    """Write every asyncio task's and thread's stack to stderr."""
    def where(frame) -> str:  # a suspended coroutine's line number can be None (so not print_stack)
        return f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n"

    out = [f"stacks of {len(asyncio.all_tasks())} tasks and {threading.active_count()} threads:\n"]
    for task in asyncio.all_tasks():
        out += [f"--- {task!r}\n", *map(where, task.get_stack(limit=12))]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)}\n")
        for _ in range(12):
            out.append(where(frame))
            if (frame := frame.f_back) is None:
                break
    sys.stderr.write("".join(out))
    sys.stderr.flush()


def run_trainer(plan: PeerPlan) -> Report:
    """Run a trainer until its stop condition or SIGINT/SIGTERM; returns its final report."""
    import uvloop

    async def main() -> Report:
        trainer = Trainer(plan)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, trainer.stop_requested.set)
        loop.add_signal_handler(signal.SIGUSR1, dump_stacks)
        loop.set_exception_handler(quiet_p2p_daemon_noise)
        return await trainer.run()

    return uvloop.run(main())
