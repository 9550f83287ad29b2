"""Pure checks of the wire helpers: message limits, codecs, partitioning."""

import msgpack
import pytest
import torch

from phalanx.aggregation.errors import PeerProtocolError
from phalanx.protocol.codec import Codec, decode, encode
from phalanx.protocol.partition import partition_bounds
from phalanx.security.wire import MAX_MESSAGE_BYTES, PeerIdStr, RoundId, WireModel, pack, unpack


class Sample(WireModel):
    count: int
    peer: PeerIdStr
    round_id: RoundId
    names: list[str]


def test_roundtrip():
    msg = Sample(count=3, peer="QmPeer", round_id=b"r" * 16, names=["a", "b"])
    assert unpack(pack(msg), Sample) == msg


@pytest.mark.parametrize(
    "obj, error",
    [
        ({"count": "3", "peer": "QmPeer", "round_id": b"r" * 16, "names": []}, "invalid Sample.count: Input should be a valid integer"),
        ({"count": 3, "peer": "Qm0l", "round_id": b"r" * 16, "names": []}, "invalid Sample.peer: String should match pattern"),
        ({"count": 3, "peer": "QmPeer", "round_id": b"r", "names": []}, "invalid Sample.round_id: Data should have at least 8 bytes"),
        ({"count": 3, "peer": "QmPeer", "round_id": b"r" * 16, "names": [], "x": 1}, "invalid Sample.x: Extra inputs are not permitted"),
        ([1, 2, 3], "invalid Sample.<root>"),
    ],
)
def test_invalid_messages_are_protocol_errors(obj, error):
    with pytest.raises(PeerProtocolError, match=error.replace("(", r"\(")):
        unpack(msgpack.packb(obj, use_bin_type=True), Sample, peer="QmBad")


def test_truncated_and_oversized_messages():
    raw = pack(Sample(count=1, peer="QmPeer", round_id=b"r" * 16, names=[]))
    with pytest.raises(PeerProtocolError, match="undecodable Sample"):
        unpack(raw[:-3], Sample)
    with pytest.raises(PeerProtocolError, match="exceeds"):
        unpack(b"\x00" * (MAX_MESSAGE_BYTES + 1), Sample)


@pytest.mark.parametrize("codec, mean_abs_error", [(Codec.NONE, 0.0), (Codec.FP16, 1e-3), (Codec.UINT8, 0.02)])
def test_codecs_roundtrip(codec, mean_abs_error):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))  # unit scale
    y = decode(bytearray(encode(x, codec)), codec, 1000)
    assert y.dtype == torch.float32 and y.shape == (1000,)
    # 8-bit clips outliers, so bound the typical error rather than the worst one
    assert (y - x).abs().mean().item() <= mean_abs_error


def test_codec_rejects_mismatched_payloads():
    x = torch.randn(100)
    with pytest.raises(PeerProtocolError, match="expected 400 bytes of float32, got 396"):
        decode(bytes(encode(x, Codec.NONE))[:-4], Codec.NONE, 100)
    with pytest.raises(PeerProtocolError, match=r"expected fp16 \[99\] float32"):
        decode(encode(x, Codec.FP16), Codec.FP16, 99)
    with pytest.raises(PeerProtocolError, match="expected 8bit"):
        decode(encode(x, Codec.FP16), Codec.UINT8, 100)
    with pytest.raises(PeerProtocolError, match="undecodable tensor"):
        decode(b"\xff" * 50, Codec.FP16, 100)


@pytest.mark.parametrize("numel, n", [(10, 3), (0, 2), (7, 7), (5, 8), (10_000_001, 4)])
def test_partition_bounds_cover_exactly(numel, n):
    bounds = partition_bounds(numel, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1
