"""Private swarms: every peer publishes its owner-signed certificate in the DHT, and every peer
refuses calls from, and never groups with, a peer whose certificate it cannot verify. DHT nodes of
the run store, under the certificate key, only certificates of their subkey's peer (`CertificateValidator`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from phalanx.errors import PeerProtocolError
from phalanx.protocol.dht_calls import dht_get, dht_store
from phalanx.protocol.dht_records import load_subkey, load_value
from phalanx.security.admission import open_certificate, verify_certificate

logger = logging.getLogger(__name__)

REFRESH_MIN_INTERVAL_S = 2.0  # an unknown caller triggers at most one DHT read per this interval


class Admission(Protocol):
    """Who may call a peer of a private swarm (an AdmissionGate; a test's double)."""

    async def admitted(self, peer: str) -> bool: ...


@dataclass
class AdmissionGate:
    dht: DHT
    key: str  # the run's certificate key in the DHT
    owner: ed25519.Ed25519PublicKey
    run_id: str
    peer_id: str
    certificate: bytes  # ours
    _valid_until: dict[str, float] = field(default_factory=dict)
    _last_refresh: float = 0.0

    async def start(self) -> None:
        body = verify_certificate(self.owner, self.certificate, peer_id=self.peer_id, run_id=self.run_id)
        self._valid_until[self.peer_id] = body.not_after
        expiration = min(get_dht_time() + 7 * 24 * 3600.0, body.not_after)
        await dht_store(self.dht, self.key, self.certificate, expiration, subkey=self.peer_id)
        await self.refresh()

    def knows(self, peer: str) -> bool:
        """Whether `peer` showed a certificate that is valid now (no network access)."""
        return self._valid_until.get(peer, 0.0) > time.time()

    async def admitted(self, peer: str) -> bool:
        if self.knows(peer):
            return True
        if time.monotonic() - self._last_refresh >= REFRESH_MIN_INTERVAL_S:
            await self.refresh()
        return self.knows(peer)

    async def refresh(self) -> None:
        self._last_refresh = time.monotonic()
        found = await dht_get(self.dht, self.key)
        if found is None or not isinstance(found.value, dict):
            return
        for subkey, entry in found.value.items():
            if not isinstance(subkey, str) or not isinstance(entry.value, bytes):
                continue
            try:
                body = verify_certificate(self.owner, entry.value, peer_id=subkey, run_id=self.run_id)
            except PeerProtocolError as e:
                logger.debug(f"ignoring a certificate for {subkey[-8:]}: {e}")
                continue
            self._valid_until[subkey] = body.not_after


class CertificateValidator(RecordValidatorBase):
    """At every DHT node of the run: values under the certificate key are certificates the owner signed
    for their subkey's peer and this run, stored to expire no later than the certificate. It checks no
    clock (a certificate that lapses while stored would void every answer that holds it): readers do."""

    def __init__(self, key: str, owner: ed25519.Ed25519PublicKey, run_id: str) -> None:
        self.key, self.owner, self.run_id = key, owner, run_id
        self._key_id = DHTID.generate(source=key).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key_id:
            return True
        try:
            subkey, raw = load_subkey(record.subkey), load_value(record.value)
            if not isinstance(subkey, str) or not isinstance(raw, bytes):
                return False
            body = open_certificate(self.owner, raw, peer_id=subkey, run_id=self.run_id)
        except (PeerProtocolError, ValueError, TypeError) as e:  # msgpack's errors are ValueErrors
            logger.debug(f"refused a certificate record: {e!r}")
            return False
        return record.expiration_time <= body.not_after

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, CertificateValidator) and other._key_id == self._key_id

    def __getstate__(self) -> dict:  # sent to the DHT process: keys travel as raw bytes
        raw = self.owner.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return {"key": self.key, "owner": raw, "run_id": self.run_id}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["key"], ed25519.Ed25519PublicKey.from_public_bytes(state["owner"]), state["run_id"])
