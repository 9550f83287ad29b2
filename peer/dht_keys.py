"""Every DHT key a run uses, with the validator each DHT node of the run applies to it.

The DHT is shared with strangers: any node may store anything under any key, and hivemind lets one
plain value replace a whole dictionary of subkeys. So no key is read or written without a validator
(protocol.dht_calls refuses a key whose validator this node has not installed), and every record
under one is signed by the peer it speaks for and bounded in size and lifetime. Readers check each
record again. Adding a key: a row here, and tests/peer/test_dht_keys.py checks its validator
refuses plain values and records in another peer's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import hivemind
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.dht.validation import RecordValidatorBase

from phalanx.peer.health.record import HealthRecordValidator, health_key
from phalanx.protocol.admission import CertificateValidator
from phalanx.protocol.bans import BanVoteValidator
from phalanx.protocol.dht_calls import validate_keys
from phalanx.protocol.dht_records import SignedRecordValidator
from phalanx.protocol.membership import membership_validator
from phalanx.security.wire import WireModel

BENCH_RANK_TTL_S = 600.0  # a bench's workers read each other's ranks once, at its start


@dataclass(frozen=True)
class DhtKey:
    name: str  # the raw key
    holds: str  # what its subkeys hold, and who may write them
    validator: RecordValidatorBase


class BenchRank(WireModel):
    """`phalanx bench allreduce`: which worker a peer is (its seeded vector follows from it)."""

    rank: int


def run_keys(run_id: str, run_key: Optional[str] = None, owner: Optional[ed25519.Ed25519PublicKey] = None) -> dict[str, DhtKey]:
    """The table. `run_id` alone: the keys every peer of a run shares, whatever its configuration (a
    bootstrap peer, `phalanx health`); `run_key` (a trainer's configuration) adds its swarm's keys, and
    `owner` (private swarms) the certificates."""
    keys = {
        "health": DhtKey(
            health_key(run_id), "signed health records, one per peer (peer/health/record.py)", HealthRecordValidator(run_id)
        ),
    }
    if run_key is not None:
        peers, bans, bench = run_key + ".peers", run_key + ".bans", run_key + ".bench-ranks"
        keys["peers"] = DhtKey(peers, "membership records signed by the peer each names", membership_validator(peers))
        keys["bans"] = DhtKey(bans, "ban votes signed by their judge, subkey <judge>/<digest>", BanVoteValidator(bans))
        keys["bench"] = DhtKey(
            bench, "phalanx bench allreduce: each worker's rank, signed", SignedRecordValidator(bench, BenchRank, BENCH_RANK_TTL_S)
        )
    if run_key is not None and owner is not None:
        certs = run_key + ".certs"
        keys["certs"] = DhtKey(certs, "the owner's certificate of each peer, under its peer ID", CertificateValidator(certs, owner, run_id))
    return keys


async def install(dht: hivemind.DHT, keys: dict[str, DhtKey]) -> None:
    """Have `dht`'s node check every key of `keys`, and let this process use them."""
    await validate_keys(dht, {key.name: key.validator for key in keys.values()})
