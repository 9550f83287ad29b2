"""A peer's health service: publishes its signed record, reads everyone's, checks legality,
answers readiness and serves HTTP. Open with `open_health(...)`, close with `aclose()`.

Every PUBLISH_EVERY_S: read all health records of the run, check the swarm's legality
against the members of this peer's last round, then sign and store this peer's record
(expiring after TTL_S). On close it publishes a last record in state "offline".
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Optional

import hivemind
from hivemind.utils import get_dht_time

from phalanx.peer.config import PROTOCOL_VERSION, NetworkSettings
from phalanx.peer.dht_keys import install, run_keys
from phalanx.peer.health.legality import LocalView, check_legality
from phalanx.peer.health.metrics import NodeCollector, PeerMetrics, package_version, render
from phalanx.peer.health.record import (
    MAX_BANS,
    MAX_VIOLATIONS,
    PUBLISH_EVERY_S,
    TTL_S,
    HealthRecord,
    bans_digest,
    health_key,
    read_records,
    sign_record,
)
from phalanx.peer.health.swarm_view import RecentPeers, Self, swarm_reasons, training_groups
from phalanx.peer.node import NodeSnapshot, visible_maddrs
from phalanx.protocol.dht_calls import dht_get, dht_store
from phalanx.protocol.hop_relay import HopRelay
from phalanx.protocol.redial import Redialer
from phalanx.security.identity import Identity

if TYPE_CHECKING:
    from phalanx.peer.health.server import HttpServer
    from phalanx.peer.node import Node
    from phalanx.peer.plan import PeerPlan

logger = logging.getLogger(__name__)


async def fetch_records(dht: hivemind.DHT, run_id: str) -> tuple[dict[str, tuple[HealthRecord, float]], int]:
    """Every valid, unexpired health record of the run: ({peer ID: (record, expiration)}, invalid count)."""
    found = await dht_get(dht, health_key(run_id))
    return read_records(found, now=get_dht_time())


async def install_validator(dht: hivemind.DHT, run_id: str) -> None:
    """Make this peer's DHT node refuse forged health records it is asked to store or is sent."""
    await install(dht, run_keys(run_id))


def reachability(maddrs: list[str], client_mode: bool, relayed: bool = False, punched: bool = False) -> str:
    """direct: others dial its own address; punched: a relay, and peers that punched a hole through its
    router connect directly; relay: only through a relay; client: not at all."""
    if client_mode:
        return "client"
    if relayed and punched:
        return "punched"
    return "relay" if relayed or not any("p2p-circuit" not in m for m in maddrs) else "direct"


class HealthService:
    """Owns the publisher task and the HTTP server of one peer (trainer or bootstrap)."""

    def __init__(
        self,
        *,
        dht: hivemind.DHT,
        identity: Identity,
        metrics: PeerMetrics,
        settings: NetworkSettings,
        config_hash: str = "",
        node: Optional[Node] = None,
        redialer: Optional[Redialer] = None,
        served_relay: Optional[HopRelay] = None,
        publish_every_s: float = PUBLISH_EVERY_S,
    ) -> None:
        self.dht, self.identity, self.metrics, self.settings, self.node = dht, identity, metrics, settings, node
        self.redialer = redialer if redialer is not None or node is None else node.redialer
        self.served_relay = served_relay if served_relay is not None or node is None else node.hop
        self.peer_id = identity.peer_id
        self.config_hash = config_hash
        self.protocol = PROTOCOL_VERSION
        self.publish_every_s = publish_every_s
        self.started_at = get_dht_time()
        self.started_monotonic = time.monotonic()
        self.addresses: list[str] = []
        self.records: dict[str, HealthRecord] = {}
        self.expirations: dict[str, float] = {}  # DHT time each record in `records` expires
        self.invalid_records = 0
        self.violations: list[str] = []
        self.swarm_problems: list[str] = []  # cut off, alone, behind, split (see swarm_view)
        self.recent = RecentPeers(self.peer_id)
        self.splits_seen = 0  # times a split swarm came into view
        self.groups_seen = 1  # training groups in view (more than 1: split)
        self.published_at: Optional[float] = None  # DHT time of the last successful store
        self.http: Optional[HttpServer] = None
        self._closing = False
        self._bans_digest = bans_digest(set())
        self._bans_changed_at = 0.0
        self._membership_refreshes = (-1, time.monotonic())  # (count, when it last changed)
        self._task: Optional[asyncio.Task] = None
        metrics.registry.register(NodeCollector(self))

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await install_validator(self.dht, self.settings.run_id)
        await self._cycle()
        self._task = asyncio.create_task(self._run(), name="health-publisher")
        if self.settings.http_port:
            from phalanx.peer.health.server import (  # aiohttp: only peers that serve HTTP pay its import
                open_http,
                peer_app,
            )

            self.http = await open_http(peer_app(self), self.settings.http_host, self.settings.http_port)

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.dht.is_alive():
            self._closing = True
            try:
                await asyncio.wait_for(self._publish(expire_in_s=self.publish_every_s), timeout=3)
            except Exception as e:
                logger.debug(f"could not publish the offline record: {e!r}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.publish_every_s)
            try:
                await self._cycle()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.debug(f"health cycle failed: {e!r}")

    async def _cycle(self) -> None:
        self.addresses = (await visible_maddrs(self.dht))[:16]
        found, self.invalid_records = await fetch_records(self.dht, self.settings.run_id)
        self.records = {peer: record for peer, (record, _) in found.items()}
        self.expirations = {peer: expiration for peer, (_, expiration) in found.items()}
        if self.redialer is not None:  # every peer of the run, the bootstrap included, with its addresses
            self.redialer.observe(
                {p: r.addresses for p, r in self.records.items() if r.state != "offline"},
                [p for p, r in self.records.items() if r.state == "offline"],
            )
        self._track_bans()
        self._track_membership()
        self.violations = self._check()[:MAX_VIOLATIONS]
        self._track_swarm()
        await self._publish(expire_in_s=TTL_S)

    # ---- what this peer publishes ---------------------------------------------------------

    def snapshot(self) -> NodeSnapshot:
        """The node's counters; a bootstrap peer (no node) has all of them at zero."""
        return self.node.snapshot() if self.node is not None else NodeSnapshot(self.peer_id)

    def bans(self) -> set[str]:
        return set(self.snapshot().banned)

    def _track_bans(self) -> None:
        digest = bans_digest(self.bans())
        if digest != self._bans_digest:
            self._bans_digest, self._bans_changed_at = digest, get_dht_time()

    def _track_membership(self) -> None:
        if self.node is not None and self.node.membership.stats.refreshes != self._membership_refreshes[0]:
            self._membership_refreshes = (self.node.membership.stats.refreshes, time.monotonic())

    def _track_swarm(self) -> None:
        self.recent.update(self.records, time.monotonic())
        now = get_dht_time()
        problems = self._swarm_reasons(self.records, now)
        groups = len(training_groups(self.records, now=now, config_hash=self.config_hash or None))
        if groups > 1 and self.groups_seen <= 1:
            self.splits_seen += 1
        self.groups_seen = max(groups, 1)
        if [p.split(":")[0] for p in problems] != [p.split(":")[0] for p in self.swarm_problems]:  # not every step
            logger.info(f"swarm view: {'; '.join(problems)}" if problems else "swarm view: sees the whole swarm again")
        self.swarm_problems = problems

    def _swarm_reasons(self, records: dict[str, HealthRecord], now: float) -> list[str]:
        engine = self.node.engine if self.node is not None else None
        last = self.metrics.last_round
        me = Self(
            peer_id=self.peer_id,
            role=self.metrics.role,
            step=self.metrics.step,
            lockstep=engine is not None and engine.config.matchmaking.lockstep,
            config_hash=self.config_hash,
            last_round_members=tuple(last.members) if last is not None else (),
            dials_out_only=self.dials_out_only(),
        )
        return swarm_reasons(me, records, self.recent.count(), now=now)[:MAX_VIOLATIONS]

    def current_swarm_problems(self) -> list[str]:
        """The swarm problems as of now: a record that expired since the last read no longer counts.
        A cut-off peer's last read can be a whole publish period (plus a slow DHT lookup) old, and
        the others' records in its own storage expire TTL_S after the cut: this makes `/readyz` say
        503 within TTL_S instead of waiting for the next cycle."""
        now = get_dht_time()
        live = {p: r for p, r in self.records.items() if self.expirations.get(p, math.inf) > now}
        if len(live) == len(self.records):
            return self.swarm_problems
        return self._swarm_reasons(live, now)

    def _check(self) -> list[str]:
        last = self.metrics.last_round
        me = LocalView(
            peer_id=self.peer_id,
            protocol=self.protocol,
            config_hash=self.config_hash,
            bans=frozenset(self.bans()),
            bans_digest=self._bans_digest,
            bans_changed_at=self._bans_changed_at,
            round_members=tuple(last.members) if last is not None else (),
        )
        return check_legality(me, self.records, now=get_dht_time())

    def state(self) -> str:
        if self._closing:
            return "offline"
        if self.metrics.role == "bootstrap":
            return "online"
        return "online" if self.metrics.in_sync else "joining"

    def record(self) -> HealthRecord:
        m, snapshot = self.metrics, self.snapshot()
        return HealthRecord(
            peer_id=self.peer_id,
            role=m.role,
            state=self.state(),
            version=package_version()[:32],
            protocol=self.protocol,
            run_id=self.settings.run_id,
            config_hash=self.config_hash,
            published_at=get_dht_time(),
            started_at=self.started_at,
            addresses=[a[:256] for a in self.addresses],
            reachability=reachability(self.addresses, self.dials_out_only(), bool(self.relayed()), self.punched()),
            relayed_bytes=snapshot.relayed_bytes,
            step=m.step,
            samples_per_s=m.samples_per_s,
            loss=m.loss,
            accuracy=m.accuracy,
            # the wire format keeps them flat: a record is signed msgpack that older peers read too
            rounds_ok=snapshot.rounds.ok,
            rounds_partial=snapshot.rounds.partial,
            rounds_failed=snapshot.rounds.failed,
            resyncs=snapshot.rounds.resyncs,
            last_round=m.last_round,
            peers_seen=self.peers_seen(),
            bans=list(snapshot.banned[:MAX_BANS]),
            bans_digest=self._bans_digest,
            bans_changed_at=self._bans_changed_at,
            accusations_seen=m.accusations_seen,
            violations=[v[:200] for v in self.violations],
            legal=not self.violations,
            leader=self.node.membership.leader() if self.node is not None else None,
            state_version=snapshot.state_version[:16],
            swarm_problems=[p[:200] for p in self.swarm_problems],
            eval_loss=m.eval_loss,
            metric=m.metric,
        )

    async def _publish(self, expire_in_s: float) -> None:
        record = self.record()
        ok = await dht_store(
            self.dht, health_key(self.settings.run_id), sign_record(self.identity, record),
            record.published_at + expire_in_s, subkey=self.peer_id,
        )  # fmt: skip
        if ok or await self._reads_back(record):
            self.published_at = record.published_at
        else:
            logger.debug("health record was not stored by any DHT node")

    async def _reads_back(self, record: HealthRecord) -> bool:
        """Whether the DHT returns `record`. hivemind's store reports the last replica's answer only: one
        node holding an outsider's plain value under the key refuses every subkey, and would make a
        record the other replicas hold look unstored (and this peer unready)."""
        try:
            found, _ = await fetch_records(self.dht, self.settings.run_id)
        except Exception as e:
            logger.debug(f"health record read-back failed: {e!r}")
            return False
        mine = found.get(self.peer_id)
        return mine is not None and mine[0].published_at == record.published_at

    # ---- what the HTTP server reads -------------------------------------------------------

    def alive(self) -> bool:
        return self.dht.is_alive()

    def dials_out_only(self) -> bool:
        """Nobody can dial this peer: `--client-mode`, or an initial peer could not dial it back and it
        holds no relay slot (or lost every relay)."""
        return self.settings.client_mode or (self.relayed() is False)

    def punched(self) -> bool:
        """A relayed peer that some relayed peers reach directly now (libp2p punched a hole)."""
        return self.node is not None and self.node.relays.stats.punched > 0

    def relayed(self) -> Optional[bool]:
        """None: others dial it directly (or it is no trainer); else whether a relay leads to it now."""
        if self.node is None or self.node.membership.reachable:
            return None
        return bool(self.node.membership.relays)

    def peers_seen(self) -> int:
        if self.node is not None:
            return len(self.node.membership.peers())
        return sum(1 for r in self.records.values() if r.role == "trainer" and r.state != "offline")

    def records_by_state(self) -> dict[str, int]:
        return dict(Counter(r.state for r in self.records.values()))

    def readiness(self) -> tuple[bool, list[str]]:
        """(ready, reasons it is not): alive, published, connected, in sync, not banned, legal, and it sees
        its whole swarm (not cut off, not training alone, not behind, not split: see swarm_view)."""
        reasons: list[str] = []
        if not self.alive():
            reasons.append("the DHT process is not running")
        if self.published_at is None or get_dht_time() - self.published_at > 3 * self.publish_every_s:
            reasons.append("health record not stored in the DHT recently")
        if self.node is not None:
            membership = self.node.membership
            quiet_s = time.monotonic() - self._membership_refreshes[1]
            if quiet_s > max(3 * self.publish_every_s, 4 * membership.refresh_s):
                reasons.append(f"membership view not refreshed for {quiet_s:.0f} s")
            if self.peer_id not in membership.peers():
                reasons.append("not yet visible in the swarm's membership")
            if not self.metrics.in_sync:
                reasons.append("not in sync: no round completed since start or the last resync")
            if self.peer_id in membership.banned:
                reasons.append("banned")
        reasons.extend(self.violations)
        reasons.extend(self.current_swarm_problems())
        return not reasons, reasons

    def metrics_text(self) -> bytes:
        return render(self.metrics.registry)

    def status(self) -> dict[str, Any]:
        ready, reasons = self.readiness()
        node, m, snapshot = self.node, self.metrics, self.snapshot()
        rounds = snapshot.rounds
        return {
            "peer_id": self.peer_id,
            "role": m.role,
            "version": package_version(),
            "protocol": self.protocol,
            "run_id": self.settings.run_id,
            "config_hash": self.config_hash,
            "addresses": self.addresses,
            "direct_addresses": node.transport.direct_addresses if node is not None else [],  # host:port of the data port
            "relays": list(node.membership.relays) if node is not None else [],  # circuits others reach it through
            "reachability": reachability(self.addresses, self.dials_out_only(), bool(self.relayed()), self.punched()),
            "state": self.state(),
            "alive": self.alive(),
            "ready": ready,
            "not_ready_because": reasons,
            "uptime_s": round(time.monotonic() - self.started_monotonic, 3),
            "step": m.step,
            "loss": m.loss,
            "accuracy": m.accuracy,
            "eval_loss": m.eval_loss,
            "metric": m.metric,  # which of accuracy and eval_loss the task is judged by
            "samples_per_s": m.samples_per_s,
            "staleness_penalty": m.staleness_penalty,
            "rounds": {
                "ok": rounds.ok,
                "partial": rounds.partial,
                "failed": rounds.failed,
                "resync": rounds.resyncs,  # named as the outcome label of phalanx_rounds and the last round's
                "last_group_size": snapshot.last_group_size,
                "last_round_s": snapshot.last_round_s,
                # why members or parts were dropped: their bytes stopped (idle) or the deadline passed (late)
                "members_dropped_idle": snapshot.members_dropped_idle,
                "members_dropped_late": snapshot.members_dropped_late,
                "parts_dropped_idle": snapshot.parts_dropped_idle,
            },
            "last_round": m.last_round.model_dump(mode="json") if m.last_round is not None else None,
            "transport": asdict(node.transport.stats) if node is not None else {},
            "bytes_sent": snapshot.bytes_sent,
            "bytes_received": snapshot.bytes_received,
            "relayed_bytes": snapshot.relayed_bytes,  # of those, through relays
            "peers_seen": self.peers_seen(),
            # reads of the membership key, and records in them that failed their signature or bounds
            "membership_reads": asdict(node.membership.stats) if node is not None else {},
            "membership": (
                {p: {"state": r.state, "step": r.step} for p, r in sorted(node.membership.peers().items())}
                if node is not None
                else {}
            ),
            "bans": list(snapshot.banned),
            "accusations_seen": m.accusations_seen,
            "disputed_parts": m.disputed_parts,
            "relayed_parts": m.relayed_parts,
            "legality": {"legal": not self.violations, "violations": self.violations},
            "swarm": {
                "problems": self.current_swarm_problems(),
                "peers_recent": self.recent.count(),
                "groups": self.groups_seen,
                "splits_seen": self.splits_seen,
                "lost_peers": self.redialer.lost() if self.redialer is not None else [],
                "redials": asdict(self.redialer.stats) if self.redialer is not None else {},
            },
            "health_records": {
                p: {
                    "role": r.role,
                    "state": r.state,
                    "step": r.step,
                    "state_version": r.state_version,
                    "age_s": round(get_dht_time() - r.published_at, 3),
                }
                for p, r in sorted(self.records.items())
            },
            "invalid_health_records": self.invalid_records,
            "http": {"url": self.http.url} if self.http is not None else None,
        }


async def open_health(
    *,
    dht: hivemind.DHT,
    identity: Identity,
    metrics: PeerMetrics,
    settings: NetworkSettings,
    config_hash: str = "",
    node: Optional[Node] = None,
    redialer: Optional[Redialer] = None,
    served_relay: Optional[HopRelay] = None,
) -> HealthService:
    """Start publishing this peer's record (and serving HTTP when --http-port is set)."""
    service = HealthService(
        dht=dht, identity=identity, metrics=metrics, settings=settings, config_hash=config_hash, node=node,
        redialer=redialer, served_relay=served_relay,
    )  # fmt: skip
    try:
        await service.start()
    except BaseException:
        await service.aclose()
        raise
    return service


async def open_node_health(node: Node, plan: PeerPlan, metrics: PeerMetrics) -> HealthService:
    """The health service of a trainer: its node's DHT, identity and stats, its run's config hash."""
    return await open_health(
        dht=node.dht,
        identity=node.identity,
        metrics=metrics,
        settings=plan.network,
        config_hash=plan.run_hash.hex(),
        node=node,
    )
