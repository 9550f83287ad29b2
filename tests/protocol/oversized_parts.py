"""The test double of a member that declares oversized parts, and a record of what receivers allocate."""

import contextlib
import mmap

import pytest

from phalanx.protocol.allreduce import PART_METHOD
from phalanx.protocol.channel import Channel

DECLARED = 1 << 30  # what the attacker declares for each of its parts


@contextlib.contextmanager
def declaring_oversized_parts(transport):
    """The attacker's transport: every part it sends is declared DECLARED bytes long. The bytes are an
    anonymous mapping, read only as far as a reducer reads them (which is not at all)."""
    real = transport.call
    ballast = mmap.mmap(-1, DECLARED)

    async def call(peer, method, header, payload=b"", **kwargs):
        return await real(peer, method, header, ballast if method == PART_METHOD else payload, **kwargs)

    transport.call = call
    try:
        yield
    finally:
        transport.call = real
        with contextlib.suppress(BufferError):  # a view still held by a closed connection goes with it
            ballast.close()


@pytest.fixture
def allocations(monkeypatch) -> list[int]:
    """The length of every payload buffer a transport allocated to receive into (every peer of the test)."""
    lengths: list[int] = []
    real = Channel.recv_payload

    async def recv_payload(self, length, into=None, hasher=None):
        if into is None:
            lengths.append(length)
        return await real(self, length, into, hasher)

    monkeypatch.setattr(Channel, "recv_payload", recv_payload)
    return lengths
