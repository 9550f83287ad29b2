"""The table of a run's DHT keys (peer/dht_keys.py): every key has a validator that takes what peers
write and refuses plain values and records in another peer's name, and nothing reads or writes the DHT
but through the keys of that table."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from phalanx.errors import PhalanxError
from phalanx.peer.dht_keys import BenchRank, run_keys
from phalanx.peer.health.record import HealthRecord
from phalanx.peer.health.record import sign_record as sign_health
from phalanx.protocol.bans import vote_subkey
from phalanx.protocol.dht_calls import dht_get, dht_store
from phalanx.protocol.membership import PeerRecord
from phalanx.security.admission import generate_owner_key, issue, load_owner_private, load_owner_public
from phalanx.security.evidence import BanVote, Offense
from phalanx.security.identity import Identity
from phalanx.security.records import sign_record
from phalanx.security.statements import sign_statement
from phalanx.security.wire import pack

ROOT = Path(__file__).resolve().parents[2]
RUN_ID, RUN_KEY = "run", "phalanx.run.0123456789abcdef"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    generate_owner_key(tmp / "owner.key", tmp / "owner.pub")
    alice, mallory = (Identity.generate_ed25519(tmp / f"{n}.id") for n in ("alice", "mallory"))
    keys = run_keys(RUN_ID, RUN_KEY, load_owner_public(tmp / "owner.pub"))
    return keys, alice, mallory, load_owner_private(tmp / "owner.key")


def _written(name: str, key: str, signer: Identity, owner) -> tuple[str, object, float]:
    """(subkey, value, expiration) as the project writes under the table's key `name`, by `signer`."""
    now = get_dht_time()
    if name == "health":
        record = HealthRecord(
            peer_id=signer.peer_id, role="trainer", state="online", version="0", protocol=3, run_id=RUN_ID, config_hash="",
            published_at=now, started_at=now, addresses=[], reachability="direct", step=1, samples_per_s=1.0,
        )  # fmt: skip
        return signer.peer_id, sign_health(signer, record), now + 10
    if name == "peers":
        value, expiration = sign_record(signer, key, PeerRecord(state="online", step=1), signed_at=now, ttl_s=8)
        return signer.peer_id, value, expiration
    if name == "bench":
        value, expiration = sign_record(signer, key, BenchRank(rank=0), signed_at=now, ttl_s=60)
        return signer.peer_id, value, expiration
    if name == "bans":
        vote = sign_statement(signer, "ban", b"", BanVote(accused=signer.peer_id, offense=Offense.WITHHELD, round_id=b"r" * 8, evidence=[]))
        return vote_subkey(vote), pack(vote), now + 3600
    if name == "certs":
        return signer.peer_id, issue(owner, signer.peer_id, RUN_ID, 3600), now + 60
    raise AssertionError(f"a new key {name!r} in peer/dht_keys.py: write here what peers store under it")


def _record(key: str, subkey, value, expiration: float) -> DHTRecord:
    tag = DHTProtocol.IS_REGULAR_VALUE if subkey is None else MSGPackSerializer.dumps(subkey)
    return DHTRecord(DHTID.generate(source=key).to_bytes(), tag, MSGPackSerializer.dumps(value), expiration)


def test_the_table_lists_every_key_of_a_private_run(world):
    keys, *_ = world
    assert set(keys) == {"health", "peers", "bans", "bench", "certs"}
    assert set(run_keys(RUN_ID)) == {"health"} and "certs" not in run_keys(RUN_ID, RUN_KEY)


@pytest.mark.parametrize("name", ["health", "peers", "bans", "bench", "certs"])
def test_each_validator_takes_what_peers_write_and_refuses_plain_values_and_forged_subkeys(world, name):
    keys, alice, mallory, owner = world
    key = keys[name]
    subkey, value, expiration = _written(name, key.name, alice, owner)
    assert key.validator.validate(_record(key.name, subkey, value, expiration)), "what peers write must pass"
    for plain in ("split", {"state": "leaving"}, value):
        assert not key.validator.validate(_record(key.name, None, plain, get_dht_time() + 3600)), "a plain value"
    forged_subkey, forged, forged_expiration = _written(name, key.name, mallory, owner)
    victim = forged_subkey.replace(mallory.peer_id, alice.peer_id)
    assert victim != forged_subkey
    assert not key.validator.validate(_record(key.name, victim, forged, forged_expiration)), "mallory's under alice's name"
    assert not key.validator.validate(_record(key.name, subkey, {"state": "leaving", "step": 0}, expiration)), "unsigned"
    other = _record(keys["peers" if name != "peers" else "bans"].name, None, "anything", 0.0)
    assert key.validator.validate(other), "another key is another validator's"


def test_records_cannot_be_kept_alive_past_their_bound(world):
    keys, alice, _, owner = world
    for name in ("health", "peers", "bench", "certs", "bans"):
        key = keys[name]
        subkey, value, _ = _written(name, key.name, alice, owner)
        far = get_dht_time() + 10 * 365 * 86400
        assert not key.validator.validate(_record(key.name, subkey, value, far)), name


def test_dht_calls_refuse_a_key_without_a_validator():
    class NotStarted:  # the check comes before any call into the DHT
        pass

    with pytest.raises(PhalanxError, match="has no validator"):
        asyncio.run(dht_get(NotStarted(), "phalanx.run.x.new-key"))
    with pytest.raises(PhalanxError, match="has no validator"):
        asyncio.run(dht_store(NotStarted(), "phalanx.run.x.new-key", b"", 0.0, subkey="me"))


# hivemind's calls that read or write DHT records, and the one place that makes them for a run
DHT_METHODS = {"store", "get", "store_many", "get_many", "get_many_by_id", "store_many_by_id"}
ALLOWED = {"protocol/dht_calls.py", "tools/doctor/swarm.py"}  # doctor: its own DHT node, made with the table's validators


def test_nothing_else_reads_or_writes_the_dht():
    offenders = []
    for package in ("peer", "protocol", "security", "sim", "tasks", "aggregation"):
        for path in (ROOT / package).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel in ALLOWED:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DHT_METHODS):
                    continue
                keywords = {k.arg for k in node.keywords}
                receiver = ast.unparse(node.func.value)
                if keywords & {"latest", "return_future", "subkey", "expiration_time"} or receiver.endswith("dht"):
                    offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not offenders, "use protocol.dht_calls.dht_get/dht_store with a key of peer/dht_keys.py:\n" + "\n".join(offenders)
