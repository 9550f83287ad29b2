"""Bans swarm-wide: signed ban votes stored in the DHT, checked by every reader and every DHT node.

Each vote is a "ban" statement signed by its judge (security.evidence.BanVote) and stored
under the run's ban key with subkey "<judge>/<vote digest>", so a node can only store
votes it signed. Readers re-check every vote and apply security.evidence.banned: provable
offenses ban on one vote, the others on votes from a majority of the round's members.
The resulting set is shared with matchmaking, membership and every RPC handler.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field

from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from phalanx.errors import PeerProtocolError
from phalanx.protocol.dht_calls import dht_get, dht_store
from phalanx.protocol.dht_records import load_subkey
from phalanx.security.evidence import BanVote, Vote, banned
from phalanx.security.records import MAX_SKEW_S
from phalanx.security.statements import Signed, Statement, open_statement
from phalanx.security.wire import pack, unpack

logger = logging.getLogger(__name__)

BAN_TTL_S = 24 * 3600.0


def vote_subkey(vote: Signed) -> str:
    judge = unpack(vote.statement, Statement).sender
    return f"{judge}/{hashlib.sha256(vote.statement).hexdigest()[:32]}"


def open_vote(raw: bytes) -> Vote:
    signed = unpack(raw, Signed)
    statement, body = open_statement(signed, BanVote, kind="ban", round_id=b"")
    return Vote(statement.sender, body)


class BanVoteValidator(RecordValidatorBase):
    """Refuses, at every DHT node, values under the ban key that are not votes signed by their subkey's judge,
    or that are to live longer than a ban (votes carry no time of their own: the bound is the node's clock)."""

    def __init__(self, raw_key: str, ttl_s: float = BAN_TTL_S) -> None:
        self.raw_key, self.ttl_s = raw_key, ttl_s
        self.key_id = DHTID.generate(source=raw_key).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self.key_id:
            return True  # not a ban record: other validators decide
        try:
            subkey = load_subkey(record.subkey)
            raw = MSGPackSerializer.loads(record.value)
            vote = open_vote(raw)
            fresh = record.expiration_time <= get_dht_time() + self.ttl_s + MAX_SKEW_S
            return isinstance(subkey, str) and subkey.split("/", 1)[0] == vote.judge and fresh
        except Exception as e:  # anything a peer sends may be malformed
            logger.debug(f"refused a ban record: {e!r}")
            return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, BanVoteValidator) and other.key_id == self.key_id  # the same check twice

    def __getstate__(self):
        return {"raw_key": self.raw_key, "ttl_s": self.ttl_s}

    def __setstate__(self, state):
        self.__init__(state["raw_key"], state["ttl_s"])


@dataclass
class BanBook:
    """This peer's view of the swarm's bans (`banned`), kept in sync with the DHT."""

    dht: DHT
    key: str
    banned: set[str]  # shared with membership, matchmaking and the transport (one set, given to each): updated in place
    ttl_s: float = BAN_TTL_S
    _votes: dict[str, Vote] = field(default_factory=dict)

    async def publish(self, votes: list[Signed]) -> None:
        self.add_local(votes)
        expiration = get_dht_time() + self.ttl_s
        for vote in votes:
            try:
                await dht_store(self.dht, self.key, pack(vote), expiration, subkey=vote_subkey(vote))
            except Exception as e:
                logger.warning(f"could not store a ban vote: {e!r}")

    def add_local(self, votes: list[Signed]) -> None:
        for vote in votes:
            try:
                self._votes[vote_subkey(vote)] = open_vote(pack(vote))
            except PeerProtocolError:
                continue
        self._apply()

    async def refresh(self) -> None:
        found = await dht_get(self.dht, self.key)
        if found is not None and isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                if subkey in self._votes or not isinstance(entry.value, bytes):
                    continue
                try:
                    vote = open_vote(entry.value)
                except PeerProtocolError:
                    continue
                if isinstance(subkey, str) and subkey.split("/", 1)[0] == vote.judge:
                    self._votes[subkey] = vote
        self._apply()

    def _apply(self) -> None:
        newly = banned(list(self._votes.values())) - self.banned
        if newly:
            logger.warning(f"banned: {sorted(p[-8:] for p in newly)}")
        self.banned.update(newly)


async def refresh_forever(book: BanBook, interval_s: float) -> None:
    while True:
        try:
            await book.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug(f"ban refresh failed: {e!r}")
        await asyncio.sleep(interval_s)
