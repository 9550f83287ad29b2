"""An outsider's DHT node writes under a live swarm's keys (docs/threat-model.md, "Outsiders: the DHT").

Before records were signed and validated, one plain value under `<run key>.peers` emptied every
trainer's view within 20 s (each trained alone, `/readyz` 503), a forged subkey evicted the leader
and split the swarm, and made-up records counted as peers for an hour. Each test attacks, then
checks at every poll, until every trainer has re-read the membership several times, that nothing
changed: all trainers see exactly each other, are ready, report no split, and train in one group."""

from __future__ import annotations

import pytest
from hivemind.utils import get_dht_time

from phalanx.protocol.membership import PeerRecord
from phalanx.security.admission import generate_owner_key, issue, load_owner_private
from phalanx.security.identity import Identity
from phalanx.security.records import sign_record
from tests.adversary.live_swarm import open_attacker, open_live_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

HOUR_S = 3600.0


def _unsigned(state: str = "online") -> dict:
    """A membership record as peers stored it before records were signed."""
    return {"state": state, "step": 10**6, "role": "trainer", "slow": [], "probation": False}


def _signed_by(identity: Identity, key: str, state: str, ttl_s: float) -> tuple[bytes, float]:
    return sign_record(identity, key, PeerRecord(state=state, step=10**6), signed_at=get_dht_time(), ttl_s=ttl_s)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with open_live_swarm(tmp_path_factory.mktemp("dht-public")) as s:
        yield s


def test_a_plain_value_under_any_run_key_changes_nothing(swarm):
    far = get_dht_time() + HOUR_S
    with open_attacker(swarm.initial_peers) as attacker:
        for key in (*(swarm.run_key + s for s in (".peers", ".bans", ".certs", ".bench-ranks")), f"phalanx.{swarm.run_id}.health"):
            attacker.store(key, "split", far)
        swarm.hold_whole()


def test_a_forged_subkey_evicts_no_one(swarm, tmp_path):
    """Each trainer's subkey (the leader's first: the lowest peer ID leads an unverified run) gets a
    "leaving" record, unsigned and signed by another key, to live an hour."""
    key, rogue = swarm.run_key + ".peers", Identity.generate_ed25519(tmp_path / "rogue.id")
    victims = sorted(t.peer_id for t in swarm.trainers)
    with open_attacker(swarm.initial_peers) as attacker:
        for victim in victims:
            attacker.store(key, _unsigned("leaving"), get_dht_time() + HOUR_S, subkey=victim)
            value, _ = _signed_by(rogue, key, "leaving", 30.0)
            attacker.store(key, value, get_dht_time() + HOUR_S + 1, subkey=victim)
        swarm.hold_whole()


def test_made_up_members_are_not_seen(swarm, tmp_path):
    """40 made-up members: 20 unsigned, 20 signed by keys of their own to live an hour (the limit is a minute)."""
    key = swarm.run_key + ".peers"
    with open_attacker(swarm.initial_peers) as attacker:
        for i in range(20):
            fake = Identity.generate_ed25519(tmp_path / f"unsigned-{i}.id").peer_id
            attacker.store(key, _unsigned(), get_dht_time() + HOUR_S, subkey=fake)
        for i in range(20):
            fake = Identity.generate_ed25519(tmp_path / f"signed-{i}.id")
            value, _ = _signed_by(fake, key, "online", HOUR_S)
            attacker.store(key, value, get_dht_time() + HOUR_S, subkey=fake.peer_id)
        swarm.hold_whole()


def test_in_a_private_swarm_an_uncertified_node_changes_nothing(tmp_path_factory):
    """The same writes from a node without the owner's certificate, plus its own validly signed record
    and a certificate for itself from a made-up owner: the trainers see only each other."""
    workdir = tmp_path_factory.mktemp("dht-private")
    with open_live_swarm(workdir, trainers=2, private=True) as swarm:
        key, certs = swarm.run_key + ".peers", swarm.run_key + ".certs"
        rogue_path = workdir / "rogue.id"
        rogue = Identity.generate_ed25519(rogue_path)
        generate_owner_key(workdir / "fake-owner.key", workdir / "fake-owner.pub")
        with open_attacker(swarm.initial_peers, identity=rogue_path) as attacker:
            attacker.store(key, "split", get_dht_time() + HOUR_S)
            attacker.store(certs, "split", get_dht_time() + HOUR_S)
            for victim in sorted(t.peer_id for t in swarm.trainers):
                attacker.store(key, _unsigned("leaving"), get_dht_time() + HOUR_S, subkey=victim)
            value, expiration = _signed_by(rogue, key, "online", 30.0)
            attacker.store(key, value, expiration, subkey=rogue.peer_id)
            cert = issue(load_owner_private(workdir / "fake-owner.key"), rogue.peer_id, swarm.run_id, 3600)
            attacker.store(certs, cert, get_dht_time() + HOUR_S, subkey=rogue.peer_id)
            swarm.hold_whole()
