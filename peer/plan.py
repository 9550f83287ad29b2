"""What a peer runs, decided once from its settings: one section per component, the parsed
rules (round, sync policy, attack, slowdown) and the run hash that peers compare.

`make_plan(PeerConfig)` is the one place the settings' strings are parsed and the cross-field
rules that need them are checked; components receive the plan (or their section), never
PeerConfig. One plan per peer process: its sync policy and attack carry state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from phalanx.errors import ConfigError
from phalanx.peer.attacks import GradientAttack, parse_attack
from phalanx.peer.config import PROTOCOL_VERSION, NetworkSettings, PeerConfig
from phalanx.peer.modes import MODES
from phalanx.peer.slowdown import Slowdown, parse_slowdown
from phalanx.protocol.btard.behavior import Behavior
from phalanx.protocol.config import RoundConfig
from phalanx.protocol.sync_policy import SyncPolicy, parse_sync_policy


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The training loop's section (peer.trainer): model, data, optimizer, stopping, checkpoints.
    Field names are the flags' (`lr` is --lr); see PeerConfig for each one's meaning."""

    task: str
    """Built-in task name or package.module:factory."""
    data_dir: Optional[Path]
    """Where the task's data files are."""
    data_file: Optional[Path]
    """The text file a language-model task trains on."""
    task_options: str
    """The task factory's options, name=value,..."""
    device: str
    """auto, cpu, cuda or cuda:N."""
    mode: str
    """sync, lasgd, gossip or diloco."""
    batch_size: Optional[int]
    """Samples per step; None: the task's."""
    lr: Optional[float]
    """Learning rate; None: the task's."""
    momentum: Optional[float]
    """SGD momentum; None: the task's."""
    weight_decay: Optional[float]
    """SGD weight decay; None: the task's."""
    seed: int
    """Seed of the initial model and of every peer's minibatches."""
    steps: Optional[int]
    """Stop after this many steps; None: run until stopped."""
    target_accuracy: Optional[float]
    """Stop once test accuracy reaches this."""
    target_loss: Optional[float]
    """Stop once the test loss is at most this."""
    eval_every: int
    """Evaluate every N steps."""
    checkpoint_dir: Optional[Path]
    """Where checkpoints go; None: no checkpoints."""
    checkpoint_every: int
    """Checkpoint every N steps."""
    checkpoint_keep: int
    """How many of the newest checkpoints stay."""
    resume: bool
    """Continue from the newest checkpoint."""
    wait_for_peers: int
    """Trainers to wait for before the first step."""
    torch_threads: Optional[int]
    """Threads torch may use; None: torch's default."""
    events: bool
    """One JSON progress event per line on stdout."""


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """The asynchronous modes' section (lasgd, gossip): when to exchange and how to correct staleness."""

    sync_every: int
    """Start an exchange every H local steps."""
    staleness: str
    """gap_aware, sa, dc or none."""
    dana: bool
    """Compute gradients at DANA's look-ahead position."""
    max_gap: int
    """Versions behind beyond which a peer downloads the model instead of contributing."""
    average_optimizer_state: bool
    """Average the momentum buffers too."""
    topk_fraction: Optional[float]
    """--compression topk:<fraction>: the share of the progress's entries sent, the rest kept as error feedback."""


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """DiLoCo's section (--mode diloco): inner steps per outer step and the outer Nesterov step."""

    inner_steps: int
    """Local steps of the inner optimizer between outer steps (H)."""
    outer_lr: float
    """The outer step's learning rate (η)."""
    outer_momentum: float
    """The outer step's momentum (μ)."""
    overlap: str
    """"on": the round of outer step t runs while the inner steps of t+1 train; "off": they wait for it."""
    topk_fraction: Optional[float]
    """--compression topk:<fraction>: the share of Δ's entries sent, the rest kept as error feedback."""
    phase_warmup: int
    """Verified runs: inner steps over which each phase's learning rate ramps up again after the fresh
    inner state (a fresh AdamW takes steps of about lr in every coordinate at first)."""


@dataclass(frozen=True)
class Attack:
    """What `--attack` makes of this peer: its protocol behaviour and its gradient attack."""

    name: Optional[str]
    """The attack's name; None: honest."""
    behavior: Behavior
    """The round's hooks (honest by default)."""
    gradient: Optional[GradientAttack]
    """Changes the peer's contribution; None for protocol attacks and honest peers."""


@dataclass(frozen=True)
class PrivateSwarm:
    owner_key: Path
    """The owner's public key: peers without a certificate it signed are refused."""
    certificate: Path
    """This peer's certificate."""


@dataclass(frozen=True, kw_only=True)
class PeerPlan:
    network: NetworkSettings
    """Addresses, identity, relays, HTTP: the DHT, the transport and the health service read these."""
    training: TrainingConfig
    exchange: ExchangeConfig
    outer: OuterConfig
    round: RoundConfig
    sync_policy: SyncPolicy
    """How many members a round waits for (one instance: AdaSync keeps state)."""
    attack: Attack
    slowdown: Optional[Slowdown]
    """Extra delay per local step; None: none."""
    private: Optional[PrivateSwarm]
    run_hash: bytes
    """SHA-256 of everything peers must agree on to train together; part of every DHT key and join."""

    @property
    def run_key(self) -> str:
        """The DHT namespace of this run's peers: the run id and a prefix of the run hash."""
        return f"phalanx.{self.network.run_id}.{self.run_hash.hex()[:16]}"


# PeerConfig fields that make_plan parses itself; every other one is a field of a section (or of
# NetworkSettings) by the same name, and tests/peer/test_plan.py checks that none is left out.
PARSED = frozenset(
    {
        "sync_policy", "slowdown", "attack", "admission", "certificate", "aggregator", "aggregator_params", "tau",
        "compression", "min_group_size", "target_group_size", "group_size", "matchmaking_timeout_s", "async_window_s",
        "allreduce_timeout_s", "part_idle_timeout_s", "verify", "validators", "phase_timeout_s",
    }
)  # fmt: skip


def make_plan(config: PeerConfig) -> PeerPlan:
    """Parse every rule of `config` once; a mistake raises ConfigError naming the flag."""
    try:
        sync_policy = parse_sync_policy(config.sync_policy)
        slowdown = parse_slowdown(config.slowdown) if config.slowdown is not None else None
    except ConfigError as e:
        raise ConfigError(f"--sync-policy / --slowdown: {e}") from None
    behavior, gradient = parse_attack(config.attack, config.seed)
    name, params = config.aggregator_spec()
    round_config = config.round_config(name, params)
    training = _section(TrainingConfig, config)
    exchange = _section(ExchangeConfig, config)
    outer = _section(OuterConfig, config)
    private = PrivateSwarm(config.admission, config.certificate) if config.admission is not None else None
    return PeerPlan(
        network=config,
        training=training,
        exchange=exchange,
        outer=outer,
        round=round_config,
        sync_policy=sync_policy,
        attack=Attack(config.attack, behavior, gradient),
        slowdown=slowdown,
        private=private,
        run_hash=run_hash(config.run_id, training, exchange, round_config, sync_policy, private, outer),
    )


def run_hash(
    run_id: str,
    training: TrainingConfig,
    exchange: ExchangeConfig,
    round_config: RoundConfig,
    sync_policy: SyncPolicy,
    private: Optional[PrivateSwarm],
    outer: OuterConfig,
) -> bytes:
    """Hash of everything peers must agree on; local fields (paths, ports, stopping) stay out, so
    peers that differ only there still meet."""
    fields: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "run_id": run_id,
        "task": training.task,
        "task_options": training.task_options,
        "mode": training.mode,
        "batch_size": training.batch_size,
        "lr": training.lr,
        "momentum": training.momentum,
        "weight_decay": training.weight_decay,
        "seed": training.seed,
        # the round itself: aggregator, codec, group sizes, timeouts the others depend on, verification
        "round": round_config.fingerprint(),
        "sync_policy": sync_policy.spec,
        "average_optimizer_state": exchange.average_optimizer_state,
        "exchanges": [exchange.sync_every, exchange.staleness, exchange.dana, exchange.topk_fraction] if not MODES[training.mode].lockstep else None,
        "outer": [outer.inner_steps, outer.outer_lr, outer.outer_momentum, outer.overlap, outer.topk_fraction, outer.phase_warmup] if training.mode == "diloco" else None,
        # peers of different private swarms (different owners) never meet
        "owner": hashlib.sha256(private.owner_key.read_bytes()).hexdigest() if private else None,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()


def _section(cls: type, config: PeerConfig):
    """A section from the settings' fields of the same names."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})
