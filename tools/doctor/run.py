"""Runs the checks in order (cheap ones first, then the network ones from our own p2pd) and prints
the table or JSON; `preflight` is the cheap part, for `phalanx join`."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from phalanx.errors import ConfigError
from phalanx.peer.config import PeerConfig
from phalanx.tools.doctor import network
from phalanx.tools.doctor.local import cheap_rows, listen_host, multiaddr_row
from phalanx.tools.doctor.rows import Row, exit_code, ok, render_table, rows_json, skipped
from phalanx.tools.doctor.swarm import clock_row, fetch_records, swarm_rows

logger = logging.getLogger(__name__)


def preflight(settings: PeerConfig) -> None:
    """Raise ConfigError with the first failing cheap row's text (one line), before anything starts."""
    for row in cheap_rows(settings, settings.initial_peers):
        if row.status == "fail":
            raise ConfigError(row.line())


async def network_rows(settings: PeerConfig, initial_peers: list[str], config_hash: str) -> list[Row]:
    p2p, daemon = await network.start_daemon(settings)
    rows = [daemon]
    free_port = f"/ip4/{listen_host(settings)}/tcp/0"
    if p2p is None and settings.listen_maddrs() != [free_port]:
        # the peer checks below still tell something from a daemon on any free port
        p2p, retry = await network.start_daemon(settings.model_copy(update={"host_maddrs": [free_port], "announce_maddrs": [], "public_ip": None}))
        if p2p is not None:
            rows.append(ok("p2p daemon on a free port", f"{retry.detail}, for the checks below"))
    if p2p is None:
        why = "the p2p daemon did not start"
        peers = network.reached_row([], 0) if not initial_peers else skipped("initial peers", why)
        skips = [skipped("reachable from outside", why), skipped("direct data port from outside", why), skipped("clock", why)]
        return rows + [peers, *skips, *swarm_rows(None, settings, config_hash, why)]
    try:
        usable = [a for a in initial_peers if multiaddr_row(a).status == "pass"]
        probes = list(await asyncio.gather(*(network.probe_initial_peer(p2p, a) for a in usable)))
        for probe in probes:
            rows += probe.rows
        rows.append(network.reached_row(probes, len(initial_peers)))
        rows.append(await network.guarded("reachable from outside", network.reachability_row(p2p, settings, probes)))
        rows.append(await network.guarded("direct data port from outside", network.direct_port_row(p2p, settings, probes)))
        identity = await network.guarded("identity free", network.identity_free_row(p2p, settings, probes))
        rows += [identity] if identity is not None else []
        reached = [p.maddrs[0] for p in probes if p.rtt_s is not None]
        records = None
        why_not = "no initial peer reachable"
        if reached:
            try:
                records, invalid = await fetch_records(p2p, reached, settings.run_id)
                if invalid:
                    logger.warning(f"dropped {invalid} invalid health record(s)")
            except Exception as e:
                why_not = f"could not read health records ({network.first_line(e)})"
        if records:
            await network.ping_more(p2p, probes, {p: r.addresses for p, r in records.items()})
        offsets = {p.peer_id: p.offset_s for p in probes if p.offset_s is not None}
        rows.append(clock_row(offsets, strict=settings.verify or settings.admission is not None))
        rows += swarm_rows(records, settings, config_hash, why_not)
    finally:
        await p2p.shutdown()
    return rows


def collect(settings: PeerConfig, initial_peers: list[str], config_hash: str) -> list[Row]:
    import uvloop

    rows = cheap_rows(settings, initial_peers)
    return rows + uvloop.run(network_rows(settings, initial_peers, config_hash))


def run_doctor(settings: PeerConfig, initial_peers: list[str], *, as_json: bool, config_hash: str) -> int:
    """Print every row; the exit status is 1 when any check failed. `config_hash` is the plan's run
    hash (hex), compared with the trainers' records."""
    rows = collect(settings, initial_peers, config_hash)
    if as_json:
        sys.stdout.write(json.dumps(rows_json(rows)) + "\n")
    else:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:
            console.width = 200  # pipes and logs: one row per line where it fits
        failed = sum(r.status == "fail" for r in rows)
        console.print(render_table(rows, title=f"phalanx doctor — run {settings.run_id!r}: {len(rows)} checks, {failed} failed"))
    return exit_code(rows)
