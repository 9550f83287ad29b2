"""What a peer knows about its own progress, and its Prometheus view.

`PeerMetrics` is the one object the training loop updates (once per round, eval or resync);
the health server, the record publisher and the `/metrics` collector only read it. Counters
the protocol already keeps are read at scrape time, from the node's snapshot (and the transport's
and membership's own stats for their details), instead of being copied, so they cannot drift apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Optional, Protocol

from hivemind.utils import get_dht_time
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from phalanx.peer.health.record import LastRound, Outcome, Role
from phalanx.tasks.metric import MetricKey

if TYPE_CHECKING:
    from phalanx.peer.health.swarm_view import RecentPeers
    from phalanx.peer.node import Node, NodeSnapshot
    from phalanx.protocol.hop_relay import HopRelay
    from phalanx.protocol.engine import Averaged, Resync
    from phalanx.protocol.matchmaking import GroupSpec
    from phalanx.protocol.redial import Redialer

ROUND_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
THROUGHPUT_HALF_LIFE_S = 10.0  # samples/s is an exponential average over roughly this long


def package_version() -> str:
    try:
        return metadata.version("phalanx")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class PeerMetrics:
    """Progress of one peer. Units: seconds, samples; `loss` is the last local minibatch loss,
    `accuracy` and `eval_loss` the last evaluation's on the task's held-out split, `metric` which
    of the two the task is judged by; `staleness_penalty` the average divisor the last late
    contribution was corrected by (0 = none yet; lasgd and gossip set it)."""

    role: Role
    clock: Callable[[], float] = time.monotonic  # for throughput
    wall_clock: Callable[[], float] = get_dht_time  # timestamps other peers read
    step: int = 0
    loss: Optional[float] = None
    accuracy: Optional[float] = None
    eval_loss: Optional[float] = None
    metric: MetricKey = "accuracy"
    samples_per_s: float = 0.0
    staleness_penalty: float = 0.0
    accusations_seen: int = 0
    disputed_parts: int = 0  # aggregates dropped because a member said they never reached it
    relayed_parts: int = 0  # aggregates this peer took from another member: their reducer failed it
    in_sync: bool = False  # completed a round since start or since the last resync
    last_round: Optional[LastRound] = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _last_step_at: Optional[float] = None

    def __post_init__(self) -> None:
        self.round_seconds = Histogram(
            "phalanx_round_duration_seconds",
            "Wall time of an averaging round (matchmaking + all-reduce).",
            buckets=ROUND_BUCKETS_S,
            registry=self.registry,
        )

    def round_done(self, *, step: int, loss: float, samples: int, averaged: Averaged, duration_s: float) -> None:
        """A round completed and its result was applied: this peer is at `step`, having trained on
        `samples` local samples since the previous round."""
        result = averaged.result
        self.step, self.loss, self.in_sync = step, loss, True
        self._count_samples(samples)
        self._round(averaged.group, "partial" if result.missing_parts or result.dropped_senders else "ok", duration_s)
        if averaged.verdict is not None:
            self.accusations_seen += averaged.verdict.accusations
            self.disputed_parts += len(averaged.verdict.disputed)
            self.relayed_parts += len(averaged.verdict.relayed)

    def round_failed(self) -> None:
        """A round raised (timeout, abort, misbehaving peer); the engine's stats count it."""
        self._last_step_at = None  # the gap is not throughput

    def resync_started(self, resync: Resync) -> None:
        """The group told this peer to download state: out of sync until it completes a round again."""
        self.in_sync = False
        self._last_step_at = None
        self._round(resync.group, "resync", None)

    def resynced(self, step: int) -> None:
        self.step = step

    def evaluated(self, metric: MetricKey, *, accuracy: float, loss: float) -> None:
        self.metric, self.accuracy, self.eval_loss = metric, accuracy, loss

    def _round(self, group: GroupSpec, outcome: Outcome, duration_s: Optional[float]) -> None:
        if duration_s is not None:
            self.round_seconds.observe(duration_s)
        self.last_round = LastRound(
            round_id=group.round_id.hex(),
            members=list(group.members),
            outcome=outcome,
            duration_s=max(0.0, duration_s or 0.0),
            finished_at=self.wall_clock(),
        )

    def _count_samples(self, samples: int) -> None:
        now = self.clock()
        if self._last_step_at is not None and now > self._last_step_at:
            rate = samples / (now - self._last_step_at)
            alpha = min(1.0, (now - self._last_step_at) / THROUGHPUT_HALF_LIFE_S)
            self.samples_per_s = rate if self.samples_per_s == 0 else (1 - alpha) * self.samples_per_s + alpha * rate
        self._last_step_at = now


class ScrapeSource(Protocol):
    """What the scrape-time families read: a HealthService, which imports this module (not the reverse)."""

    metrics: PeerMetrics
    protocol: int
    peer_id: str
    config_hash: str
    started_monotonic: float
    node: Optional[Node]
    redialer: Optional[Redialer]
    served_relay: Optional[HopRelay]
    violations: list[str]
    swarm_problems: list[str]
    recent: RecentPeers
    groups_seen: int
    splits_seen: int

    def readiness(self) -> tuple[bool, list[str]]: ...
    def snapshot(self) -> NodeSnapshot: ...
    def peers_seen(self) -> int: ...
    def records_by_state(self) -> dict[str, int]: ...
    def bans(self) -> set[str]: ...


class NodeCollector(Collector):
    """Prometheus families computed at scrape time from a `HealthService`."""

    def __init__(self, service: ScrapeSource) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = self.service
        m = s.metrics
        info = InfoMetricFamily("phalanx_build", "Version, protocol, role and configuration of this peer.")
        info.add_metric(
            [],
            {
                "version": package_version(),
                "protocol": str(s.protocol),
                "role": m.role,
                "peer_id": s.peer_id,
                "config_hash": s.config_hash[:16],
            },
        )
        yield info
        yield _gauge("phalanx_up_seconds", "Seconds since this peer started.", time.monotonic() - s.started_monotonic)
        yield _gauge("phalanx_ready", "1 when /readyz answers 200.", float(s.readiness()[0]))
        yield _gauge("phalanx_peers_seen", "Trainers announced in this peer's membership view.", s.peers_seen())
        states = GaugeMetricFamily(
            "phalanx_health_records", "Valid health records this peer reads, by state.", labels=["state"]
        )
        for state, count in sorted(s.records_by_state().items()):
            states.add_metric([state], count)
        yield states
        snapshot = s.snapshot()
        counts = snapshot.rounds
        rounds = CounterMetricFamily("phalanx_rounds", "Averaging rounds by outcome.", labels=["outcome"])
        for outcome, value in (
            ("ok", counts.ok),
            ("partial", counts.partial),
            ("failed", counts.failed),
            ("resync", counts.resyncs),
        ):
            rounds.add_metric([outcome], value)
        yield rounds
        yield _counter("phalanx_bytes_sent", "Bytes sent by the round transport.", snapshot.bytes_sent)
        yield _counter("phalanx_bytes_received", "Bytes received by the round transport.", snapshot.bytes_received)
        yield _counter(
            "phalanx_relayed_bytes",
            "Of the bytes sent and received, those to and from peers reached through a relay.",
            snapshot.relayed_bytes,
        )
        transport = s.node.transport.stats if s.node is not None else None  # its calls by path, below
        relays = s.node.relays.stats if s.node is not None else None
        yield GaugeMetricFamily(
            "phalanx_relay_circuits", "Relays this peer is reachable through now (0: dialed directly, or unreachable).",
            value=relays.circuits if relays else 0,
        )
        yield GaugeMetricFamily(
            "phalanx_relayed_peers", "Trainers in view that are reached through a relay.", value=relays.relayed_peers if relays else 0
        )
        yield GaugeMetricFamily(
            "phalanx_punched_peers", "Of the relayed trainers, those connected directly now (a hole punched).",
            value=relays.punched if relays else 0,
        )
        served = s.served_relay.stats if s.served_relay is not None else None  # the relay this peer serves
        yield GaugeMetricFamily(
            "phalanx_relay_reservations", "Peers holding a slot on this peer's relay now.", value=served.reservations if served else 0
        )
        yield GaugeMetricFamily(
            "phalanx_relay_served_circuits", "Relayed connections through this peer open now.", value=served.circuits if served else 0
        )
        yield _counter("phalanx_relay_served_bytes", "Bytes this peer relayed for others, both ways.", served.relayed_bytes if served else 0)
        calls = CounterMetricFamily("phalanx_transport_calls", "Transport calls by path.", labels=["path"])
        for path in ("direct", "stream", "unary", "failed"):
            calls.add_metric([path], getattr(transport, f"{path}_calls") if transport else 0)
        yield calls
        closed = CounterMetricFamily(
            "phalanx_direct_connections_closed",
            "Connections to the direct data port closed unserved: a cap was full (refused) or no valid hello came (dropped).",
            labels=["why"],
        )
        for why in ("refused", "dropped"):
            closed.add_metric([why], getattr(transport, f"direct_{why}") if transport else 0)
        yield closed
        membership = s.node.membership.stats if s.node is not None else None
        yield _counter(
            "phalanx_invalid_records",
            "Membership records read from the DHT that failed their signature or bounds.",
            membership.invalid_records if membership else 0,
        )
        yield _gauge(
            "phalanx_samples_per_second", "Training samples per second (exponential average).", m.samples_per_s
        )
        yield _gauge("phalanx_step", "Training step of this peer's parameters.", m.step)
        if m.loss is not None:
            yield _gauge("phalanx_loss", "Last minibatch loss.", m.loss)
        if m.accuracy is not None:
            yield _gauge("phalanx_accuracy", "Accuracy of the last evaluation on the task's held-out split.", m.accuracy)
        if m.eval_loss is not None:
            yield _gauge("phalanx_eval_loss", "Loss of the last evaluation on the task's held-out split.", m.eval_loss)
        yield _gauge(
            "phalanx_staleness_penalty",
            "Last staleness penalty applied to a late contribution (0: none).",
            m.staleness_penalty,
        )
        yield _gauge("phalanx_bans", "Peers this peer has banned.", len(s.bans()))
        yield _counter("phalanx_accusations_seen", "Accusations this peer has seen.", m.accusations_seen)
        yield _counter(
            "phalanx_disputed_parts", "Aggregates dropped because a member said they never reached it.", m.disputed_parts
        )
        yield _counter(
            "phalanx_relayed_parts",
            "Aggregates this peer took from another member because their reducer failed to deliver them.",
            m.relayed_parts,
        )
        yield _gauge("phalanx_legality_violations", "Violations found by the local legality check.", len(s.violations))
        yield _gauge(
            "phalanx_swarm_problems", "Reasons this peer does not see its whole swarm (cut off, behind, split).",
            len(s.swarm_problems),
        )  # fmt: skip
        yield _gauge("phalanx_peers_recent", "Peers of the run seen in the last 2 minutes (itself included).", s.recent.count())
        yield _gauge("phalanx_swarm_groups", "Groups of trainers training apart in this peer's view (over 1: split).", s.groups_seen)
        yield _counter("phalanx_splits_seen", "Times a split swarm came into this peer's view.", s.splits_seen)
        stats = s.redialer.stats if s.redialer is not None else None
        yield _gauge("phalanx_peers_lost", "Known peers out of view that this peer keeps re-dialing.", stats.lost if stats else 0)
        redials = CounterMetricFamily("phalanx_redials", "Pings sent to lost peers, by outcome.", labels=["outcome"])
        redials.add_metric(["answered"], stats.answered if stats else 0)
        redials.add_metric(["unanswered"], stats.dials - stats.answered if stats else 0)
        yield redials


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of `registry`."""
    return generate_latest(registry)
