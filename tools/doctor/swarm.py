"""Checks against the peers in view: clocks (from DHT pings) and protocol version, package version
and run-configuration hash (from their signed health records)."""

from __future__ import annotations

import asyncio
from typing import Optional

from phalanx.peer.config import PROTOCOL_VERSION, PeerConfig
from phalanx.peer.health.record import TTL_S, HealthRecord, read_records
from phalanx.protocol.engine import GROUP_FRESH_S
from phalanx.tools.doctor.local import short
from phalanx.tools.doctor.rows import Row, failed, ok, skipped, warned

CLOCK_OK_S = TTL_S  # further off, the peers' health records expire (or come from the future) in each other's views
RECORDS_TIMEOUT_S = 20.0
CLOCK_FIX = "set this machine's clock (enable NTP: timedatectl set-ntp true), or tell the peer's owner theirs is off"


def clock_row(offsets_s: dict[str, float], *, strict: bool) -> Row:
    """Verdict on `offsets_s` ({peer ID: its clock minus ours, s}). Verified runs and private swarms
    (`strict`) refuse statements and certificates more than GROUP_FRESH_S off: that fails; any run
    warns from CLOCK_OK_S on, before anything is refused. Tests pass offsets here directly."""
    check = "clock"
    if not offsets_s:
        return skipped(check, "no peer answered a ping, so no clock to compare with")
    peer, offset = max(offsets_s.items(), key=lambda kv: abs(kv[1]))
    side = "ahead of" if offset > 0 else "behind"
    seen = f"peer {short(peer)} is {abs(offset):.1f} s {side} this machine (largest of {len(offsets_s)})"
    if abs(offset) <= CLOCK_OK_S:
        return ok(check, seen)
    if abs(offset) > GROUP_FRESH_S and strict:
        return failed(check, seen + f"; verified runs and certificates refuse anything over {GROUP_FRESH_S:.0f} s off", CLOCK_FIX)
    refused = f"; over {GROUP_FRESH_S:.0f} s, --verify and --admission runs refuse its statements" if abs(offset) <= GROUP_FRESH_S else "; this run would refuse it with --verify or --admission"
    return warned(check, seen + f": health records expire in each other's views{refused}", CLOCK_FIX)


async def fetch_records(p2p, initial_peers: list[str], run_id: str) -> tuple[dict[str, HealthRecord], int]:
    """Every valid health record of the run, read through a client-mode DHT node on our own p2pd."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.validation import CompositeValidator
    from hivemind.utils import get_dht_time

    from phalanx.peer.dht_keys import run_keys

    keys = run_keys(run_id)  # the answers it gets are checked as a peer of the run checks them
    validator = CompositeValidator(key.validator for key in keys.values())
    create = DHTNode.create(p2p=p2p, initial_peers=initial_peers, client_mode=True, record_validator=validator)
    node = await asyncio.wait_for(create, RECORDS_TIMEOUT_S)
    try:
        found = await asyncio.wait_for(node.get(keys["health"].name, latest=True), RECORDS_TIMEOUT_S)
    finally:
        await node.shutdown()
    records, invalid = read_records(found, now=get_dht_time())
    return {peer: record for peer, (record, _) in records.items()}, invalid


def swarm_rows(
    records: Optional[dict[str, HealthRecord]], settings: PeerConfig, config_hash: str, why_not: str = ""
) -> list[Row]:
    """Protocol version, package version and run-configuration hash (`config_hash`: the plan's run
    hash, hex) against the records in view."""
    names = ("protocol version", "package version", "run config")
    if records is None:
        return [skipped(n, why_not) for n in names]
    if not records:
        return [skipped(n, f"no health records of run {settings.run_id!r} in the DHT (is --run-id right?)") for n in names]
    rows = []
    other = {p: r.protocol for p, r in records.items() if r.protocol != PROTOCOL_VERSION}
    if other:
        peer, protocol = next(iter(other.items()))
        rows.append(failed(names[0], f"{len(other)} of {len(records)} peers speak protocol {protocol} (e.g. {short(peer)}), this install {PROTOCOL_VERSION}", "install the phalanx version the swarm runs (pip install -U phalanx), or ask the swarm's organiser which"))
    else:
        rows.append(ok(names[0], f"protocol {PROTOCOL_VERSION}, as all {len(records)} peers in view"))
    from phalanx.peer.health.metrics import package_version

    mine = package_version()[:32]  # as records carry it
    versions = sorted({r.version for r in records.values()} - {mine})
    if versions:
        rows.append(warned(names[1], f"peers run phalanx {', '.join(versions)}, this install {mine}", "the same protocol still trains together; upgrade to match when you can"))
    else:
        rows.append(ok(names[1], f"phalanx {mine}, as all peers in view"))
    trainers = {p: r.config_hash for p, r in records.items() if r.role == "trainer"}
    ours = config_hash
    if not trainers:
        rows.append(skipped(names[2], "no trainer in view to compare the run configuration with"))
        return rows
    differ = {p: h for p, h in trainers.items() if h != ours}
    if differ:
        peer, theirs = next(iter(differ.items()))
        rows.append(failed(names[2], f"{len(differ)} of {len(trainers)} trainers run config {theirs[:12]} (e.g. {short(peer)}), these flags give {ours[:12]}", "peers group only with the same --task, --mode, --aggregator(-params), --tau, --lr, --momentum, --weight-decay, --batch-size, --seed, --compression, --sync-policy, --verify: use the swarm's"))
    else:
        rows.append(ok(names[2], f"config {ours[:12]}, as all {len(trainers)} trainers in view"))
    return rows
