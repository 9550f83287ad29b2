"""`phalanx join`'s process: a task's model and optimizer wrapped in `phalanx.Optimizer` (peer/optimizer.py),
and the loop a researcher would write around it, plus what a volunteer's peer adds: `--attack`, the
eval and checkpoint cadence, `--events`, stopping.

    batch = task.batch(seed, peer, opt.position)        the public batch validators recompute
    task.loss(model, batch).backward(); opt.step()      every mode: sync, lasgd, gossip, diloco

SIGINT/SIGTERM stop the loop between steps (a round it waits for is left) and write a final
checkpoint; until training starts, the process stops at once (it has nothing to save). SIGUSR1 logs
what every thread and task is doing (for a peer that seems stuck).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, cast

import torch

from phalanx.aggregation.spec import parse_params
from phalanx.errors import ConfigError, PhalanxError
from phalanx.peer.checkpoint import Checkpoint, load_latest, save_checkpoint
from phalanx.peer.config import PeerConfig
from phalanx.peer.health import PeerMetrics
from phalanx.peer.local_sgd import look_ahead
from phalanx.peer.memory import release_large_frees
from phalanx.peer.model import Model, resolve_device, zero_optimizer_state
from phalanx.peer.modes.diloco import DiLoCoMode
from phalanx.peer.node import DHT_DIED, visible_maddrs
from phalanx.peer.optimizer import Interrupted, JoinHooks, Optimizer
from phalanx.peer.outer_step import OuterStep, phase_lr_scale, write_flat
from phalanx.peer.plan import PeerPlan, TrainingConfig
from phalanx.protocol.round_counts import RoundCounts
from phalanx.tasks import ACCURACY, VALIDATION_LOSS, Task, compute_gradient, resolve_task

logger = logging.getLogger(__name__)

EVENT_EVERY_S = 0.5  # step events at most this often (a fast peer would flood stdout)
LOG_EVERY = 50  # steps between progress lines in the log
DHT_DEATH_GRACE_S = 2.0  # a signal to the process group stops the DHT too: let ours arrive first


# --group-size: after a first stop signal, how long the last step and the end rounds (SyncMode.converge) may
# take before the optimizer is interrupted (`phalanx swarm` waits 30 s for its trainers to stop)
AGREE_GRACE_S = 15.0


@dataclass
class Report:
    peer_id: str = ""
    step: int = 0
    loss: Optional[float] = None
    accuracy: Optional[float] = None
    rounds: RoundCounts = RoundCounts()  # in the "done" event: {"ok": …, "partial": …, "failed": …, "resyncs": …}
    group_size: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float = 0.0
    reached_target: bool = False
    param_hash: str = ""
    banned: list[str] = field(default_factory=list)  # peers this one saw banned
    attack: Optional[str] = None
    peak_rss_bytes: int = 0  # this process's peak resident memory (not its DHT process or p2pd)
    param_sketch: list[float] = field(default_factory=list)  # --group-size: Trainable.param_sketch, for the spread


def run_trainer(plan: PeerPlan) -> Report:
    """Run a trainer until its stop condition or SIGINT/SIGTERM; returns its final report."""
    return Trainer(plan).run()


class Trainer:
    def __init__(self, plan: PeerPlan) -> None:
        self.plan, self.config = plan, plan.training
        config = plan.training
        release_large_frees()  # before the model's tensors exist
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.device = resolve_device(config.device)
        self.task = resolve_task(config.task, **task_options(config)).to(self.device)
        self.target = run_target(self.task, config)
        self.model = Model(self.task, config)
        self.model.lr_factor = None  # the schedule is a scheduler on the optimizer, following opt.position
        self.batch_size = config.batch_size or self.task.batch_size
        self.attack = plan.attack.gradient
        # diloco attackers take honest inner steps (label_flip: on flipped labels) and attack Δ instead
        self.attacks_gradient = self.attack is not None and config.mode != "diloco"
        self.attacks_delta = config.mode == "diloco" and self.attack is not None and not self.attack.flips_labels
        self.report = Report(attack=plan.attack.name)
        # the health server's; the optimizer updates it per round, the evaluations here
        self.health = PeerMetrics(role="trainer", metric=self.task.metric.key)
        self.stopping = threading.Event()
        self._interrupted = False  # the optimizer was interrupted: no round runs any more
        self._agreed = 0  # rounds that averaged the models alone at the end (not training steps)
        # --group-size: the peers' models differ until the last rounds (SyncMode.converge), which a first stop
        # signal still runs
        self._grouped = plan.round.matchmaking.group_size is not None
        self.opt: Optional[Optimizer] = None
        self._last_event = 0.0
        self._evaluated_at: Optional[int] = None  # the global step of the last evaluation
        # an evaluation and a checkpoint wait for a step where the mode is settled (diloco with overlap: no
        # round in flight)
        self._eval_due = self._checkpoint_due = False
        self._shared_module: Optional[torch.nn.Module] = None  # a copy of the model at the swarm's parameters
        self._replica: Optional[Model] = None  # diloco attackers: a copy for honest Δs on other batches

    # ---- the run --------------------------------------------------------------------------------

    def run(self) -> Report:
        started = time.monotonic()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGUSR1, lambda *_: dump_stacks(self.opt))
        resumed = self._load_checkpoint()
        scheduler = torch.optim.lr_scheduler.LambdaLR(self.model.optimizer, self.task.lr_factor)
        hooks = JoinHooks(
            opened=self._opened, contribute=self._attacked if self.attacks_delta else None, event=self._event,
            metrics=self.health,
        )  # fmt: skip
        opt = self.opt = Optimizer.for_plan(
            self.plan, self.model, model=self.model.module, scheduler=scheduler, hooks=hooks,
            batch_fn=self.public_batch, loss_fn=self.loss, batch_size_per_step=self.batch_size,
            state=None if resumed is None else {"optimizer": resumed.optimizer_state, **resumed.extra["swarm"]},
        )  # fmt: skip
        try:
            self.emit("training", step=opt.position, peers=len(opt.node.membership.peers()))
            self._train(opt)
        finally:
            self._finish(opt, started)
        return self.report

    def _train(self, opt: Optimizer) -> None:
        try:
            while not self._done(opt.position) and self._node_ok(opt):
                before = opt.position
                try:
                    loss = float(opt.step(lambda: self._backward(opt)))
                except PhalanxError as e:
                    if isinstance(e, Interrupted) or (DHT_DIED in str(e) and self._stop_arrives()):
                        return
                    raise
                opt.zero_grad()
                self._stepped(opt, loss, before)
                if self.plan.slowdown is not None:
                    self.stopping.wait(self.plan.slowdown.draw(self._slow_rng))
            if not opt.mode.settled and not self.stopping.is_set():
                opt.mode.flush()  # the last boundary waits for its round, so the peer stops on θ of it
                if self._eval_due or self._evaluated_at != opt.global_step:
                    self._evaluate(opt)
            if self._grouped and not self._interrupted:
                self._agreed = opt.mode.converge()
                if self._agreed:
                    self._evaluate(opt)  # the model every peer now holds
        except Interrupted:
            return

    def _backward(self, opt: Optimizer) -> torch.Tensor:
        """The closure of `opt.step`: this step's gradient into the parameters' .grad, on the public batch
        of opt.position, and the loss; with --attack, what the attacker sends instead (diloco: honest
        inner steps, and the pseudo-gradient is attacked)."""
        module, step, peer_id = self.model.module, opt.position, opt.node.peer_id
        dana = self.plan.exchange.dana and self.config.mode in ("lasgd", "gossip")
        with self._look_ahead(opt) if dana else nullcontext():
            if self.attack is None:
                loss = self.loss(module, self.public_batch(self.config.seed, peer_id, step))
                loss.backward()
                return loss.detach()
            loss, grad = self._gradient(module, peer_id, step, flip_labels=self.attack.flips_labels)
            if self.attacks_gradient:
                extra = lambda k: self._gradient(module, f"{peer_id}/extra{k}", step)[1]  # noqa: E731
                grad = self.attack.contribution(step, grad, extra)
        offset = 0
        for p in module.parameters():
            p.grad = grad[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return torch.tensor(loss)

    def public_batch(self, seed: int, peer_id: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`peer_id`'s batch of `step`: what validators recompute a contribution from."""
        return self.task.batch(seed, peer_id, step, self.batch_size)

    def loss(self, module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.task.loss(module, *batch)

    def _look_ahead(self, opt: Optimizer):
        """DANA: the gradient at the point the momentum carries the parameters to."""
        params, group = self.model.params, self.model.optimizer.param_groups[0]
        buffers = [self.model.optimizer.state[p].get("momentum_buffer") for p in params]
        return look_ahead(params, buffers, group["lr"], group.get("momentum", 0.0))

    def _gradient(self, module, peer_id: str, step: int, *, flip_labels: bool = False) -> tuple[float, torch.Tensor]:
        """`peer_id`'s gradient of `step` at `module` (label_flip: on flipped labels), flat."""
        if not flip_labels:
            return compute_gradient(self.task, module, self.config.seed, peer_id, step, self.batch_size)
        module.zero_grad(set_to_none=True)
        inputs, targets = self.task.batch(self.config.seed, peer_id, step, self.batch_size)
        classes = int(self.task.train_targets.max()) + 1
        loss = self.task.loss(module, inputs, classes - 1 - targets)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
        return loss.item(), torch.nn.utils.parameters_to_vector(grads)

    def _stepped(self, opt: Optimizer, loss: float, position_before: int) -> None:
        """After a step: the report, events and a log line now and then, eval and checkpoint by cadence."""
        position, config = opt.position, self.config
        if position == position_before:
            return  # sync: the round's outcome was a resync that failed to download; nothing was taken
        self.report.loss = loss
        stats = opt.statistics()
        self.report.group_size = stats.peers_last_round or self.report.group_size
        now = time.monotonic()
        if now - self._last_event >= EVENT_EVERY_S:
            self._last_event = now
            self.emit("step", step=position, loss=loss, group=stats.peers_last_round, bytes_sent=stats.bytes_sent)
        if position % LOG_EVERY == 0:
            logger.info(f"step {position} loss {loss:.4f} (global step {opt.global_step}, group {stats.peers_last_round})")
        last = config.steps is not None and position >= config.steps
        if position % config.eval_every == 0 or last:
            self._eval_due = True
        busy = not opt.mode.settled
        # the swarm's parameters change only at a global step: a due evaluation of them waits for the next
        # one rather than repeat the last (diloco with H = 50 and --eval-every 10: four in five would)
        shared = opt.mode.shared_parameters() is not None
        stale = shared and self._evaluated_at == opt.global_step and not last
        if self._eval_due and not busy and not stale:
            self._evaluate(opt)
        if config.checkpoint_dir is not None and (position % config.checkpoint_every == 0 or self._checkpoint_due):
            self._checkpoint_due = busy
            if not busy:
                self._checkpoint(opt)

    # ---- stopping -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if self.opt is None:  # still starting (waiting for its initial peers may take minutes): nothing to save
            logger.info(f"{sig.name} before the peer was up: stopping now")
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)  # its DHT process and p2pd follow their parent
            return
        if self._grouped and not self.stopping.is_set():
            # the swarm is stopping together (a target reached): its last rounds bring it onto one model, if
            # they come within AGREE_GRACE_S (a swarm that cannot form them is not waited for)
            logger.info(
                f"{sig.name}: stopping after this step and the rounds that end on one model, at most "
                f"{AGREE_GRACE_S:g} s (again: now)"
            )
            self.stopping.set()
            timer = threading.Timer(AGREE_GRACE_S, self._interrupt)
            timer.daemon = True
            timer.start()
            return
        if not self.stopping.is_set():
            logger.info(f"{sig.name}: stopping after this step")
        self.stopping.set()
        self._interrupt()

    def _interrupt(self) -> None:
        self._interrupted = True
        self.opt.interrupt()

    def _done(self, position: int) -> bool:
        """A stop was requested, --steps are taken or the target (--target-accuracy or --target-loss) is reached."""
        if self.stopping.is_set():
            return True
        if self.config.steps is not None and position >= self.config.steps:
            return True
        return self.report.reached_target

    def _node_ok(self, opt: Optimizer) -> bool:
        """False when a stop came; raises rather than train on alone when the swarm is out of reach."""
        node = opt.node
        if node.peer_id in node.membership.banned:
            raise PhalanxError("the swarm banned this peer (its ban votes are in the DHT and the log); stopping")
        if not node.dht.is_alive() and not self._stop_arrives():
            raise PhalanxError(f"{DHT_DIED}: the swarm is out of reach; stopping")
        return not self.stopping.is_set()

    def _stop_arrives(self) -> bool:
        """Whether a stop signal comes within the grace (the DHT died: was it told to stop with us?)."""
        return self.stopping.wait(DHT_DEATH_GRACE_S)

    def _finish(self, opt: Optimizer, started: float) -> None:
        """The report, a final checkpoint and the node's close: after any end, an error's too."""
        try:
            report, node = self.report, opt.node
            report.peer_id = node.peer_id
            report.step = opt.position - self._agreed
            report.wall_s = time.monotonic() - started
            report.param_hash = self.model.param_hash()
            if self._grouped:
                report.param_sketch = self.model.param_sketch()
            snapshot = node.snapshot()
            report.rounds, report.banned = snapshot.rounds, list(snapshot.banned)
            report.bytes_sent, report.bytes_received = snapshot.bytes_sent, snapshot.bytes_received
            report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if self.config.checkpoint_dir is not None and report.step > 0:  # counted as --checkpoint-every counts
                path = self._checkpoint(opt)
                logger.info(f"checkpoint saved: {path} (step {report.step}); continue with --resume")
        finally:
            opt.close()
            self.emit("done", **asdict(self.report))

    # ---- what the optimizer tells -----------------------------------------------------------------

    async def _opened(self, opt: Optimizer) -> None:
        """The node is up and holds the state we start from (before waiting for the other trainers)."""
        node = opt.node
        self.report.peer_id = node.peer_id
        self._slow_rng = self.plan.slowdown.sampler(self.config.seed, node.peer_id) if self.plan.slowdown else None
        logger.info(
            f"peer {node.peer_id} training {self.config.task} on {self.device} "
            f"({self.model.numel} parameters, step {opt.position})"
        )
        if not self.plan.network.initial_peers:
            from phalanx.peer.bootstrap import initial_peers_line

            logger.info(f"others join this new swarm with: {initial_peers_line(await visible_maddrs(node.dht))}")
        self.emit("started", peer_id=node.peer_id, step=opt.position, params=self.model.numel,
                  param_hash=self.model.param_hash(), metric=self.task.metric.key)  # fmt: skip

    def _event(self, name: str, **fields: Any) -> None:
        position = self.opt.position if self.opt is not None else 0
        if name in ("resynced", "outer"):
            self.emit(name, step=position, **fields)
        elif name == "penalty":
            self.emit("penalty", **fields)

    def emit(self, event: str, **fields: Any) -> None:
        """One JSON line on stdout with --events (what the swarm launcher and tests read)."""
        if self.config.events:
            sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            sys.stdout.flush()

    # ---- evaluation and checkpoints ------------------------------------------------------------

    def _evaluate(self, opt: Optimizer) -> None:
        """The task's metrics on the swarm's model: its shared parameters where the mode keeps them apart
        (diloco's θ_t, the same on every peer), else ours."""
        shared = opt.mode.shared_parameters()
        module = self.model.module if shared is None else self._at(shared)
        metrics = self.task.evaluate(module)
        self._evaluated_at, self._eval_due = opt.global_step, False
        metric = self.task.metric
        self.report.accuracy = metrics["accuracy"]
        self.health.evaluated(metric.key, accuracy=metrics["accuracy"], loss=metrics["loss"])
        step = opt.position
        others = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k not in (metric.key, "perplexity"))
        logger.info(f"step {step} {metric.text(metrics[metric.key])}; {others}")
        outer = {"outer_step": opt.global_step} if shared is not None else {}
        self.emit("eval", step=step, **outer, metric=metric.key, **metrics)
        if self.target is not None and metric.reached(metrics[metric.key], self.target):
            self.report.reached_target = True

    def _at(self, params: torch.Tensor) -> torch.nn.Module:
        """A copy of the model at the flat `params`, with the module's buffers as they are now."""
        module = self.model.module
        if self._shared_module is None:
            self._shared_module = copy.deepcopy(module)
        self._shared_module.load_state_dict(module.state_dict())
        write_flat([p for p in self._shared_module.parameters() if p.requires_grad], params)
        return self._shared_module

    def _checkpoint(self, opt: Optimizer) -> Path:
        """The model, the task's optimizer, and the rest of `opt.state_dict()` (global step; diloco's θ_t
        and v; lasgd's base) as extra["swarm"]."""
        swarm = opt.state_dict()
        optimizer_state = swarm.pop("optimizer")
        return save_checkpoint(
            self.config.checkpoint_dir,
            step=opt.position,
            model_state=self.model.module.state_dict(),
            optimizer_state=optimizer_state,
            extra={"task": self.config.task, "run_id": self.plan.network.run_id, "mode": self.config.mode, "swarm": swarm},
            keep=self.config.checkpoint_keep,
        )

    def _load_checkpoint(self) -> Optional[Checkpoint]:
        """--resume: the model now (the node's first state is of these parameters), the optimizer's
        state once it is up."""
        if not self.config.resume:
            return None
        ckpt = load_latest(self.config.checkpoint_dir)
        if ckpt is None:
            logger.info(f"no checkpoint in {self.config.checkpoint_dir}; starting from scratch")
            return None
        mode = ckpt.extra.get("mode")
        if not isinstance(ckpt.extra.get("swarm"), dict) or mode != self.config.mode:
            raise ConfigError(
                f"--resume: {ckpt.path} was written by {f'--mode {mode}' if mode else 'an older phalanx'}; "
                f"resume it with that, or start this run with another --checkpoint-dir"
            )
        self.model.module.load_state_dict(ckpt.model_state, strict=True)
        logger.info(f"resumed from {ckpt.path.name} at step {ckpt.step}")
        return ckpt

    # ---- diloco attackers ----------------------------------------------------------------------

    def _attacked(self, outer_step: int, delta: torch.Tensor) -> torch.Tensor:
        """The attack's version of this peer's pseudo-gradient; its statistics (ALIE's and the others')
        are those of honest Δs it recomputes from θ_t on other batches of its own."""
        assert self.attack is not None and self.opt is not None
        peer_id = self.opt.node.peer_id
        return self.attack.contribution(outer_step, delta, lambda k: self._replay(f"{peer_id}/extra{k}"))

    def _replay(self, batch_key: str) -> torch.Tensor:
        """Δ of H inner steps from θ_t on `batch_key`'s batches, on a copy of the model: from a fresh
        inner state in verified runs, as every peer's phase starts there; otherwise from our own."""
        assert self.opt is not None
        outer, model = _outer(self.opt), self.model
        if self._replica is None:
            self._replica = copy.deepcopy(model, {id(model.task): model.task})  # the task's data stay shared
            self._replica.lr_factor = self.task.lr_factor
        replica = self._replica
        write_flat(replica.params, outer.anchor)
        verified = self.plan.round.verify is not None
        if verified:
            zero_optimizer_state(replica.optimizer)
        else:
            # a copy: load_state_dict keeps tensors that need no cast, which would share our own state
            replica.optimizer.load_state_dict(copy.deepcopy(model.optimizer.state_dict()))
        first = outer.step * outer.inner_steps
        for step in range(first, first + outer.inner_steps):
            _, grad = self._gradient(replica.module, batch_key, step)
            scale = phase_lr_scale(step - first, self.plan.outer.phase_warmup) if verified else 1.0
            replica.apply(grad, step, scale)
        return outer.anchor - torch.cat([p.detach().reshape(-1).to(torch.float32) for p in replica.params])


def _outer(opt: Optimizer) -> OuterStep:
    """diloco's outer state: θ_t (`anchor`), v, the outer step."""
    return cast(DiLoCoMode, opt.mode).outer


def dump_stacks(opt: Optional[Optimizer]) -> None:
    """Write every asyncio task's (on the swarm's loop) and thread's stack to stderr."""

    def where(frame) -> str:  # a suspended coroutine's line number can be None (so not print_stack)
        return f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n"

    tasks = asyncio.all_tasks(opt.swarm_loop) if opt is not None else set()
    out = [f"stacks of {len(tasks)} tasks and {threading.active_count()} threads:\n"]
    for task in tasks:
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


def run_target(task: Task, config: TrainingConfig | PeerConfig) -> Optional[float]:
    """The target a run stops at, in the task's metric: --target-accuracy or --target-loss, whichever is
    the task's (None: neither given); the other one is a mistake, said in one line."""
    given = {ACCURACY: config.target_accuracy, VALIDATION_LOSS: config.target_loss}
    for metric, value in given.items():
        if value is not None and metric != task.metric:
            better = "higher" if task.metric.higher_is_better else "lower"
            raise ConfigError(
                f"{metric.flag} {value:g}: task {task.name} is judged by its {task.metric.label} ({better} is "
                f"better), not its {metric.label}; use {task.metric.flag}"
            )
    return given[task.metric]


def task_options(config: TrainingConfig) -> dict[str, Any]:
    """The task factory's keyword arguments: --data-dir, --data-file and --task-options name=value pairs."""
    options: dict[str, Any] = dict(parse_params(config.task_options))
    for name in ("data_dir", "data_file"):
        if getattr(config, name) is not None:
            if name in options:
                raise ConfigError(f"--task-options {name}= and --{name.replace('_', '-')} both give it: keep one")
            options[name] = getattr(config, name)
    return options
