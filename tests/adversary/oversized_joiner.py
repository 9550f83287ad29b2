"""`python oversized_joiner.py <phalanx args…>`: `phalanx join` as a round member that declares every
part it sends to be 1 GiB long, to make reducers allocate that much before reading a byte. The bytes
are an anonymous mapping nobody reads. With `--attack oversized_part` it signs that size too."""

import mmap
import sys

from phalanx.protocol.allreduce import PART_METHOD
from phalanx.protocol.transport import Transport

DECLARED = 1 << 30
_ballast = mmap.mmap(-1, DECLARED)
_call = Transport.call


async def call(self, peer, method, header, payload=b"", **kwargs):
    return await _call(self, peer, method, header, memoryview(_ballast) if method == PART_METHOD else payload, **kwargs)


Transport.call = call

from phalanx.cli import main  # noqa: E402

main(sys.argv[1:])
