"""Fuzz every RPC handler of a live peer with malformed, oversized and wrongly signed messages:
each is refused with a status (never a crash or a hang), and the peer keeps serving real rounds."""

import asyncio
import os
import random

import msgpack
import pytest
import torch

from phalanx.errors import PeerProtocolError
from phalanx.protocol.allreduce import PART_METHOD, PartHeader
from phalanx.protocol.btard.messages import EVIDENCE_METHOD, RELAY_METHOD, EvidenceRequest, RelayRequest
from phalanx.protocol.config import MatchmakingConfig, RoundConfig, verify_config_for
from phalanx.protocol.engine import Averaged, RoundRequest
from phalanx.protocol.exchange import EXCHANGE_METHOD, ExchangeHeader
from phalanx.protocol.matchmaking import JOIN_METHOD, JoinRequest
from phalanx.protocol.state_sync import CHECK_METHOD, STATE_METHOD, CheckRequest, StateRequest
from phalanx.protocol.transport import HELLO_MAGIC, CallFailed, Status
from phalanx.security.statements import Signed
from phalanx.security.wire import pack
from tests.protocol.swarm_fixture import RUN_HASH, open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PARAMS = (("tau", 1.0),)
CONFIG = RoundConfig(
    aggregator="centered_clip",
    aggregator_params=PARAMS,
    verify=verify_config_for("centered_clip", PARAMS, phase_timeout_s=3.0),
    allreduce_timeout_s=5.0,
    matchmaking=MatchmakingConfig(matchmaking_timeout_s=2.0, join_timeout_s=30.0),
)


def _garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return os.urandom(rng.randrange(0, 300))
    if kind == 1:
        return msgpack.packb({"round_id": os.urandom(16), "part": rng.randrange(-5, 300), "x": 1})
    if kind == 2:
        return msgpack.packb([1, 2, 3] * rng.randrange(1, 50))
    if kind == 3:
        return msgpack.packb({"a" * 40: b"\x00" * rng.randrange(1000)})
    if kind == 4:
        return b"\xdd\xff\xff\xff\xff"  # an array claiming 4 billion items
    return msgpack.packb("x" * rng.randrange(10, 5000))


def _shaped(rng: random.Random, target_round: bytes) -> list[tuple[str, bytes, bytes]]:
    """Well-formed headers with wrong contents: unknown rounds, bad signatures, absurd sizes."""
    bad_sig = pack(Signed(statement=os.urandom(60), public_key=os.urandom(40), signature=os.urandom(64)))
    return [
        (JOIN_METHOD, pack(JoinRequest(run=os.urandom(32), version=b"", step=0)), b""),
        (JOIN_METHOD, pack(JoinRequest.model_construct(run=RUN_HASH, version=os.urandom(32), step=-5)), b"x"),
        (PART_METHOD, pack(PartHeader(round_id=os.urandom(16), part=0, numel=10, codec="none", weight=1.0)), b"\x00" * 40),
        (PART_METHOD, pack(PartHeader(round_id=target_round, part=99, numel=10**9, codec="zip", weight=1e30, signature=bad_sig)), b"\x00" * 8),
        (STATE_METHOD, pack(StateRequest(round_id=os.urandom(16))), b""),
        (CHECK_METHOD, pack(CheckRequest.model_construct(round_id=os.urandom(16), seed=b"short")), b""),
        (EXCHANGE_METHOD, pack(ExchangeHeader(round_id=os.urandom(16), phase="commit")), bad_sig),
        (EXCHANGE_METHOD, pack(ExchangeHeader(round_id=target_round, phase="reveal")), os.urandom(100)),
        (EXCHANGE_METHOD, msgpack.packb({"round_id": target_round, "phase": "made-up"}), b"\x00" * 1000),
        (EVIDENCE_METHOD, pack(EvidenceRequest(round_id=os.urandom(16), part=0, contributor="QmFuzz")), b""),
        (RELAY_METHOD, pack(RelayRequest(round_id=os.urandom(16), part=0, payload=True)), b""),
        (RELAY_METHOD, pack(RelayRequest.model_construct(round_id=target_round, part=300, payload=True)), b"x" * 10),
        ("no-such-method", b"", b""),
    ]


def test_handlers_refuse_garbage_and_the_peer_keeps_serving():
    async def main():
        async with open_swarm(3, CONFIG) as peers:
            target, fuzzer, third = peers
            rng = random.Random(0)
            methods = [JOIN_METHOD, PART_METHOD, STATE_METHOD, EXCHANGE_METHOD, EVIDENCE_METHOD, RELAY_METHOD, CHECK_METHOD]
            outcomes = []
            for i in range(60):
                method = methods[i % len(methods)]
                large = i % 2 == 1  # both the libp2p unary path and the sealed direct path
                try:
                    await fuzzer.transport.call(
                        target.peer_id, method, _garbage(rng), _garbage(rng), max_reply_payload=1 << 20,
                        timeout_s=15, expect_large_reply=large,
                    )  # fmt: skip
                    outcomes.append("answered")
                except CallFailed as e:
                    outcomes.append(e.status)
                except PeerProtocolError:
                    outcomes.append("bad reply")
            assert set(outcomes) <= {Status.REJECTED, Status.UNKNOWN_METHOD, Status.ABORTED}, outcomes
            for method, header, payload in _shaped(rng, os.urandom(16)):
                with pytest.raises((CallFailed, PeerProtocolError)):
                    await fuzzer.transport.call(target.peer_id, method, header, payload, max_reply_payload=1 << 20, timeout_s=15)
            # oversized declarations are refused before anything is read
            with pytest.raises(CallFailed, match="exceeds"):
                await fuzzer.transport.call(
                    target.peer_id, JOIN_METHOD, b"", b"x" * (1 << 20), max_reply_payload=0, timeout_s=15
                )
            # raw bytes on the direct socket: dropped without harm
            host, port = target.transport.direct_addresses[0].rsplit(":", 1)
            for blob in (HELLO_MAGIC + os.urandom(16) + os.urandom(1000), os.urandom(5000), b""):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(blob)
                await writer.drain()
                writer.close()
            # and the target still runs a full verified round with the others
            for peer in peers:
                peer.engine.set_state(b"v", 0)
            xs = [torch.randn(5000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
            results = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)])
            assert all(isinstance(r, Averaged) and not r.verdict.banned for r in results)

    asyncio.run(main())
