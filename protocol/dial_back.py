"""Dial-back of a direct data port: can other peers open TCP to the port a peer's bulk bytes use?

libp2p's AutoNAT answers this for the libp2p port only; the direct tensor path listens on a port
of its own (`--direct-port`), which a firewall or NAT may close while libp2p gets through. A peer
asks another over libp2p to connect to a port at the address that libp2p connection comes from
(never another host, so the service cannot be aimed at third parties) and to send the nonce it
chose; it then checks the nonce arrived. One dial per asker at a time, a few at once in all, each
bounded by CONNECT_TIMEOUT_S. Every peer serves it, bootstrap peers included; in a private swarm,
only to admitted peers (otherwise anyone could map which ports of their own address answer).
"""

from __future__ import annotations

import asyncio
import random
import secrets
import logging
from typing import Annotated, Optional

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from pydantic import Field

from phalanx.protocol.admission import Admission
from phalanx.security.wire import WireModel, pack, unpack

logger = logging.getLogger(__name__)

NAMESPACE = "phalanx.dial_back"
MAGIC = b"phalanx-dial-back"  # then the asker's nonce: all the dialer ever sends
NONCE_BYTES = 16
CONNECT_TIMEOUT_S = 3.0
MAX_DIALS = 4  # dials under way at once, all askers together
BUSY = "busy with other dial-backs; ask again"
BUSY_TRIES = 8  # a peer asks again this often while its askers are busy (a swarm started at once asks together)
BUSY_RETRY_S = 0.25  # ... after about this, times the attempt, jittered
NOT_ADMITTED = "not admitted to this swarm (no valid certificate): no dial-back"


class DialBackRequest(WireModel):
    port: Annotated[int, Field(ge=1, le=65535)]  # TCP port at the asker's observed address
    nonce: Annotated[bytes, Field(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]


class DialBackReply(WireModel):
    reached: bool  # the TCP connection opened and the nonce was sent
    address: Annotated[str, Field(max_length=80)] = ""  # host:port dialed ("" when none could be)
    error: Annotated[str, Field(max_length=200)] = ""  # why not, when not reached


class DialBackService(ServicerBase):
    """The serving side. Open with `await DialBackService.open(p2p)`; it lives as long as the daemon."""

    def __init__(self, p2p: P2P, admission: Optional[Admission] = None) -> None:
        self.p2p = p2p
        self.admission = admission
        self._dialing: set[str] = set()

    @classmethod
    async def open(cls, p2p: P2P, admission: Optional[Admission] = None) -> DialBackService:
        """`admission`: a private swarm's gate; callers it does not admit are refused without a dial."""
        self = cls(p2p, admission)
        await self.add_p2p_handlers(p2p, namespace=NAMESPACE)
        return self

    async def rpc_dial_back(self, request: BytesValue, context: P2PContext) -> BytesValue:
        asker = context.remote_id
        key = asker.to_base58()
        if self.admission is not None and not await self.admission.admitted(key):
            return BytesValue(value=pack(DialBackReply(reached=False, error=NOT_ADMITTED)))
        ask = unpack(request.value, DialBackRequest, peer=key)
        if key in self._dialing or len(self._dialing) >= MAX_DIALS:
            return BytesValue(value=pack(DialBackReply(reached=False, error=BUSY)))
        self._dialing.add(key)
        try:
            reply = await self._dial(asker, ask)
        finally:
            self._dialing.discard(key)
        return BytesValue(value=pack(reply))

    async def _dial(self, asker: PeerID, ask: DialBackRequest) -> DialBackReply:
        host = await observed_host(self.p2p, asker)
        if host is None:
            return DialBackReply(reached=False, error="no direct libp2p connection to you (relayed?): nothing to dial")
        address = f"[{host}]:{ask.port}" if ":" in host else f"{host}:{ask.port}"
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, writer = await asyncio.open_connection(host, ask.port)
        except (OSError, TimeoutError) as e:
            why = f"no answer within {CONNECT_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else (e.strerror or repr(e))
            return DialBackReply(reached=False, address=address, error=why[:200])
        try:
            writer.write(MAGIC + ask.nonce)
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await writer.drain()
        except (OSError, TimeoutError) as e:
            return DialBackReply(reached=False, address=address, error=f"connected, then the send failed: {e!r}"[:200])
        finally:
            writer.close()
        logger.debug(f"dialed {address} back for {asker.to_base58()[-8:]}")
        return DialBackReply(reached=True, address=address)


async def observed_host(p2p: P2P, peer: PeerID) -> Optional[str]:
    """The IP address a peer's libp2p connection to us comes from (not a relay's), or None."""
    for info in await p2p.list_peers():
        if info.peer_id != peer:
            continue
        for addr in info.addrs:
            parts = str(addr).split("/")  # /ip4/10.0.0.5/tcp/4001
            if "p2p-circuit" not in parts and len(parts) > 2 and parts[1] in ("ip4", "ip6"):
                return parts[2]
    return None


async def request_dial_back(p2p: P2P, peer: PeerID, port: int, nonce: bytes, timeout_s: float) -> DialBackReply:
    """Ask `peer` to connect to `port` at our address as it sees it and send `nonce` there."""
    stub = DialBackService.get_stub(p2p, peer, namespace=NAMESPACE)
    async with asyncio.timeout(timeout_s):
        response = await stub.rpc_dial_back(BytesValue(value=pack(DialBackRequest(port=port, nonce=nonce))))
    return unpack(response.value, DialBackReply, peer=peer.to_base58())


async def dialable(p2p: P2P, askers: list[PeerID], port: int, *, timeout_s: float = CONNECT_TIMEOUT_S + 5.0) -> Optional[bool]:
    """Whether others can open TCP to `port` (our libp2p port) at our address as they see it: the first of
    `askers` that answers says. None when none of them answers (a peer of an older version, or one busy with
    other dial-backs BUSY_TRIES times: a whole swarm starting at once). A home router without port forwarding,
    or a firewall, makes it False: such a peer dials out only."""
    nonce = secrets.token_bytes(NONCE_BYTES)  # what the dialer sends is only read by our data port, not p2pd
    for attempt in range(BUSY_TRIES):
        busy = False
        for asker in askers:
            try:
                reply = await request_dial_back(p2p, asker, port, nonce, timeout_s)
            except Exception as e:  # not connected, no such service, a timeout: ask the next one
                logger.debug(f"{asker.to_base58()[-8:]} did not answer a dial-back request: {e!r}")
                continue
            if not reply.reached and reply.error == BUSY:
                busy = True
                continue
            logger.info(
                f"{asker.to_base58()[-8:]} {'reached' if reply.reached else 'could not reach'} our port {port}"
                f"{f' at {reply.address}' if reply.address else ''}{f' ({reply.error})' if reply.error else ''}"
            )
            return reply.reached
        if not busy:
            return None
        await asyncio.sleep(BUSY_RETRY_S * (1 + random.random()) * (attempt + 1))
    return None
