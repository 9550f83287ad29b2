"""A dial-back test through libp2p's AutoNAT service (protocol /libp2p/autonat/1.0.0), which every
hivemind p2pd runs: we ask a peer we reached to dial our addresses on a fresh connection, and it
answers whether that worked. The two messages are encoded by hand (proto2, varint-delimited):

    Message { type = 1 (DIAL = 0, DIAL_RESPONSE = 1); dial = 2; dialResponse = 3 }
    Dial { peer = 1: PeerInfo { id = 1: bytes; addrs = 2: repeated bytes } }
    DialResponse { status = 1 (OK 0, E_DIAL_ERROR 100, E_DIAL_REFUSED 101, E_BAD_REQUEST 200,
                   E_INTERNAL_ERROR 300); statusText = 2: string; addr = 3: bytes }
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from phalanx.security.identity import read_varint  # the same protobuf varint the libp2p key files use

PROTOCOL = "/libp2p/autonat/1.0.0"
MAX_RESPONSE_BYTES = 4096  # a response is a status, a short text and one address
OK, E_DIAL_ERROR, E_DIAL_REFUSED = 0, 100, 101
STATUS_NAMES = {0: "OK", 100: "E_DIAL_ERROR", 101: "E_DIAL_REFUSED", 200: "E_BAD_REQUEST", 300: "E_INTERNAL_ERROR"}


@dataclass(frozen=True)
class DialResponse:
    status: int
    text: str
    addr: Optional[bytes]  # the address it reached us at (binary multiaddr), on OK


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of one protobuf message: varints and length-delimited only."""
    out, pos = [], 0
    while pos < len(data):
        tag, pos = read_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = read_varint(data, pos)
        elif wire == 2:
            length, pos = read_varint(data, pos)
            if pos + length > len(data):
                raise ValueError("field runs past the message")
            value, pos = data[pos : pos + length], pos + length
        else:
            raise ValueError(f"unexpected wire type {wire}")
        out.append((number, value))
    return out


def encode_dial(peer_id: bytes, addrs: list[bytes]) -> bytes:
    """The DIAL message, varint length first."""
    info = _field(1, peer_id) + b"".join(_field(2, a) for a in addrs)
    message = _field(1, 0) + _field(2, _field(1, info))
    return _varint(len(message)) + message


def decode_response(framed: bytes) -> DialResponse:
    """A DIAL_RESPONSE (varint length first); ValueError for anything else."""
    length, pos = read_varint(framed, 0)
    if length > MAX_RESPONSE_BYTES or pos + length != len(framed):
        raise ValueError("response length does not match its frame")
    top = dict(_fields(framed[pos:]))
    if top.get(1) != 1 or not isinstance(top.get(3), bytes):
        raise ValueError("not a DIAL_RESPONSE")
    fields = dict(_fields(top[3]))
    status, text, addr = fields.get(1, OK), fields.get(2, b""), fields.get(3)
    if not isinstance(status, int) or not isinstance(text, bytes) or not (addr is None or isinstance(addr, bytes)):
        raise ValueError("malformed DialResponse")
    return DialResponse(status, text.decode("utf-8", errors="replace")[:200], addr)


async def request_dial_back(p2p, peer, own_addrs: list[bytes], *, timeout_s: float) -> DialResponse:
    """Ask `peer` (a hivemind PeerID we are connected to) to dial `own_addrs` back."""
    _, reader, writer = await asyncio.wait_for(p2p._client.stream_open(peer, [PROTOCOL]), timeout_s)
    try:
        writer.write(encode_dial(p2p.peer_id.to_bytes(), own_addrs))
        await writer.drain()
        framed = b""
        while True:  # a varint prefix, then exactly that many bytes
            chunk = await asyncio.wait_for(reader.read(MAX_RESPONSE_BYTES + 16 - len(framed)), timeout_s)
            if not chunk:
                raise ValueError("the peer closed the stream without an answer")
            framed += chunk
            try:
                length, pos = read_varint(framed, 0)
            except ValueError:
                continue
            if length > MAX_RESPONSE_BYTES:
                raise ValueError("oversized AutoNAT response")
            if len(framed) >= pos + length:
                return decode_response(framed[: pos + length])
    finally:
        writer.close()
