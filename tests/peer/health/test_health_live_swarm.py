"""A live swarm on loopback, inspected the way a user would: each peer's HTTP endpoints,
`phalanx health --json`, and a forged record that honest readers never see."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import hivemind
import pytest
from hivemind.utils import get_dht_time
from prometheus_client.parser import text_string_to_metric_families

from phalanx.peer.health.record import HealthRecord, health_key, sign_record
from phalanx.security.identity import Identity
from tests.peer.health.health_swarm import WAIT_S, get_json, http_get, wait_until
from tests.procs import LOOPBACK

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _metrics(url: str) -> dict[str, list]:
    status, body = http_get(url + "/metrics")
    assert status == 200
    return {f.name: f.samples for f in text_string_to_metric_families(body.decode())}


def test_trainer_serves_healthz_readyz_metrics_and_status(live_swarm):
    trainer = live_swarm.trainers[0]
    status, body = get_json(trainer.url + "/healthz")
    assert status == 200 and body == {"alive": True, "peer_id": trainer.peer_id}
    status, body = get_json(trainer.url + "/readyz")
    assert status == 200 and body["ready"] is True and body["reasons"] == []

    families = _metrics(trainer.url)
    rounds = {s.labels["outcome"]: s.value for s in families["phalanx_rounds"]}
    assert rounds["ok"] >= 1 and set(rounds) == {"ok", "partial", "failed", "resync"}
    assert families["phalanx_peers_seen"][0].value == 2
    assert families["phalanx_bytes_sent"][0].value > 0 and families["phalanx_bytes_received"][0].value > 0
    assert any(
        s.name == "phalanx_round_duration_seconds_count" and s.value >= 1
        for s in families["phalanx_round_duration_seconds"]
    )
    assert families["phalanx_step"][0].value >= 1
    for name in (
        "phalanx_samples_per_second",
        "phalanx_loss",
        "phalanx_staleness_penalty",
        "phalanx_bans",
        "phalanx_accusations_seen",
        "phalanx_disputed_parts",
        "phalanx_relayed_parts",
        "phalanx_direct_connections_closed",
        "phalanx_invalid_records",
    ):
        assert name in families, name
    build = families["phalanx_build_info"][0].labels
    assert build["role"] == "trainer" and build["peer_id"] == trainer.peer_id and build["version"]

    status, s = get_json(trainer.url + "/api/v1/status")
    assert status == 200
    assert s["peer_id"] == trainer.peer_id and s["role"] == "trainer" and s["state"] == "online" and s["ready"]
    assert s["addresses"] and all(trainer.peer_id in a for a in s["addresses"])
    assert len(s["config_hash"]) == 64 and s["version"] and s["protocol"] >= 1
    assert s["rounds"]["ok"] >= 1 and s["legality"] == {"legal": True, "violations": []}
    assert set(s["membership"]) == {t.peer_id for t in live_swarm.trainers}
    wait_until(  # it reads everyone's signed record (each peer publishes every few seconds)
        lambda: live_swarm.peer_ids <= set(get_json(trainer.url + "/api/v1/status")[1]["health_records"]),
        "every record in the trainer's view",
        live_swarm.procs,
    )


def test_throughput_is_the_trainers_samples_per_second_everywhere_it_is_shown(live_swarm):
    """Every trainer trains (digits, 32 samples a step), so each place that shows its samples/s shows more
    than 0: its metrics and status, its health record in `phalanx health` and the monitor (its table and
    metrics; the throughput plot draws the same records). All of them read 0 for the whole run while the
    optimizer counted a round's samples after the round had reset them."""
    trainer_ids = {t.peer_id for t in live_swarm.trainers}

    def everywhere() -> bool:
        for t in live_swarm.trainers:
            if _metrics(t.url)["phalanx_samples_per_second"][0].value <= 0:
                return False
            if get_json(t.url + "/api/v1/status")[1]["samples_per_s"] <= 0:
                return False
        monitor = get_json(live_swarm.monitor.url + "/api/v1/peers")[1]
        plotted = {p["peer_id"]: p["samples_per_s"] for p in monitor["peers"]}
        per_peer = {s.labels["peer"]: s.value for s in _metrics(live_swarm.monitor.url)["phalanx_swarm_peer_samples_per_second"]}
        return all(plotted.get(p, 0) > 0 and per_peer.get(p, 0) > 0 for p in trainer_ids)

    wait_until(everywhere, "every trainer's throughput above 0 in its metrics, status and the monitor", live_swarm.procs)
    rows = {p["peer_id"]: p for p in _health_json(live_swarm)["peers"]}
    assert all(rows[p]["samples_per_s"] > 0 for p in trainer_ids), rows


def test_bootstrap_serves_healthz_and_publishes_its_record(live_swarm):
    boot = live_swarm.bootstrap
    assert http_get(boot.url + "/healthz")[0] == 200
    assert http_get(boot.url + "/readyz")[0] == 200
    status, s = get_json(boot.url + "/api/v1/status")
    assert s["role"] == "bootstrap" and s["state"] == "online"
    families = _metrics(boot.url)  # it serves the swarm's relay; on loopback nobody needs it
    for name in ("phalanx_relay_reservations", "phalanx_relay_served_circuits", "phalanx_relay_served_bytes"):
        assert name in families and families[name][0].value == 0, name


def _health_json(swarm, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "--log-format", "json", "health", "--initial-peers", ",".join(swarm.initial_peers),
         "--host-maddrs", LOOPBACK, "--json", *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for line in filter(None, done.stderr.splitlines()):  # --log-format json holds for this command too
        json.loads(line)
    return json.loads(done.stdout)


def test_phalanx_health_json_lists_every_peer(live_swarm):
    report = _health_json(live_swarm, "--expect", "3", "--timeout-s", "120")
    peers = {p["peer_id"]: p for p in report["peers"]}
    assert set(peers) == live_swarm.peer_ids
    assert peers[live_swarm.bootstrap.peer_id]["role"] == "bootstrap"
    for t in live_swarm.trainers:
        row = peers[t.peer_id]
        assert row["role"] == "trainer" and row["state"] == "online" and row["rounds"]["ok"] >= 1
        assert row["short_id"] == t.peer_id[-8:] and row["reachability"] == "direct"
        assert row["problems"] == [] and row["legal"] is True


def test_forged_record_is_never_seen_by_honest_readers(live_swarm, tmp_path):
    """A rogue DHT node (no validator) stores a record naming a trainer but signed with its own key,
    and a record under its own ID whose bytes were changed after signing. Readers drop both."""
    victim = live_swarm.trainers[0]
    rogue_identity = Identity.generate_ed25519(tmp_path / "rogue.id")
    rogue = hivemind.DHT(initial_peers=live_swarm.initial_peers, host_maddrs=[LOOPBACK], start=True)
    try:
        now = get_dht_time()
        fake = HealthRecord(
            peer_id=rogue_identity.peer_id, role="trainer", state="online", version="0.1.0", protocol=1, run_id="phalanx",
            config_hash="", published_at=now, started_at=now, addresses=[], reachability="direct", step=10**9, samples_per_s=1e9,
        )  # fmt: skip
        forged = sign_record(rogue_identity, fake)  # a valid signature, but by the rogue's key ...
        forged["record"] = fake.model_copy(update={"peer_id": victim.peer_id}).encode()  # ... over other bytes
        rogue.store(health_key("phalanx"), forged, now + 8, subkey=victim.peer_id)
        tampered = sign_record(rogue_identity, fake)
        tampered["record"] = fake.model_copy(update={"step": 10**9 + 1}).encode()
        rogue.store(health_key("phalanx"), tampered, now + 8, subkey=rogue_identity.peer_id)

        report = _health_json(live_swarm)
        peers = {p["peer_id"]: p for p in report["peers"]}
        assert rogue_identity.peer_id not in peers
        assert peers[victim.peer_id]["step"] < 10**9 and peers[victim.peer_id]["samples_per_s"] < 1e9
    finally:
        rogue.shutdown()


# ---- the monitor ----------------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


def _monitor_sees_everyone(swarm) -> bool:
    status, body = get_json(swarm.monitor.url + "/api/v1/peers")
    online = {p["peer_id"] for p in body["peers"] if p["state"] == "online"}
    return status == 200 and swarm.peer_ids <= online and body["polls"] >= 3


def test_monitor_json_api_and_aggregated_metrics(live_swarm):
    wait_until(lambda: _monitor_sees_everyone(live_swarm), "the monitor to list every peer online", live_swarm.procs)
    status, body = get_json(live_swarm.monitor.url + "/api/v1/status")
    assert status == 200 and body["monitor"]["ready"] is True
    assert {p["peer_id"] for p in body["peers"]} == live_swarm.peer_ids
    assert http_get(live_swarm.monitor.url + "/readyz")[0] == 200
    families = _metrics(live_swarm.monitor.url)
    by_state = {s.labels["state"]: s.value for s in families["phalanx_swarm_peers"]}
    assert by_state["online"] == 3
    steps = {s.labels["peer"]: s.value for s in families["phalanx_swarm_peer_step"]}
    assert set(steps) == live_swarm.peer_ids
    assert all(steps[t.peer_id] >= 1 for t in live_swarm.trainers)


def test_monitor_page_in_chromium_shows_every_peer_and_its_plots_render(live_swarm):
    if not CHROMIUM.exists():
        pytest.skip(
            "NOT RUN: the dashboard browser test needs Debian's chromium at /usr/bin/chromium "
            "(apt-get install -y chromium chromium-driver); .ci/run installs it"
        )
    from playwright.sync_api import sync_playwright

    wait_until(lambda: _monitor_sees_everyone(live_swarm), "the monitor to list every peer online", live_swarm.procs)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(WAIT_S * 1000)  # a loaded CI machine is slow, not broken
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(live_swarm.monitor.url + "/", wait_until="domcontentloaded")
            assert "Phalanx swarm" in page.title()
            for peer in live_swarm.peer_ids:
                page.wait_for_selector(f'#peers tr[data-peer-id="{peer}"]')
                assert peer[-8:] in page.inner_text(f'#peers tr[data-peer-id="{peer}"]')
            page.wait_for_function(
                "() => { const imgs = [...document.querySelectorAll('img.plot')];"
                " return imgs.length === 4 && imgs.every(i => i.complete && i.naturalWidth > 0); }"
            )
            plots = page.evaluate(
                "[...document.querySelectorAll('img.plot')].map(i => [i.dataset.kind, i.naturalWidth, i.naturalHeight])"
            )
            assert sorted(kind for kind, _, _ in plots) == ["evaluation", "loss", "states", "throughput"]
            assert all(w > 100 and h > 100 for _, w, h in plots), plots
            page.wait_for_function("() => document.getElementById('summary').textContent.includes('poll')")
            assert not errors, errors
        finally:
            browser.close()
