"""Pure checks of the wire helpers: message limits, codecs, partitioning."""

import msgpack
import pytest
import torch

from phalanx.errors import PeerProtocolError
from phalanx.protocol.allreduce import MAX_PART_BYTES
from phalanx.protocol.codec import MAX_PART_NUMEL, Codec, check_payload_size, decode, encode, encoded_size_bound
from phalanx.protocol.partition import partition_bounds
from phalanx.security.commitments import HIVEMIND_SLACK_BYTES, max_part_bytes
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


# how far above what encode() writes the bound may lie: nothing for our own formats; hivemind's framing
# leaves room for fields an honest encoder leaves at their defaults
BOUND_SLACK = {
    Codec.NONE: 0,
    Codec.INT8: 0,
    Codec.SPARSE: 0,
    Codec.FP16: HIVEMIND_SLACK_BYTES,
    Codec.UINT8: HIVEMIND_SLACK_BYTES,
}


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("numel", [1, 2, 127, 128, 255, 256, 257, 16_383, 16_384, 100_003, 2_097_157])
def test_each_codec_size_bound_holds_and_is_tight(codec, numel):
    """A reducer refuses a part whose declared length exceeds the bound before reading it: an honest
    encoding must never exceed it, and an over-declaring sender may make it allocate only a few bytes more."""
    g = torch.Generator().manual_seed(numel)
    for x in (torch.randn(numel, generator=g) * 10.0, torch.zeros(numel), torch.full((numel,), 65504.0 * 4)):
        size = len(encode(x, codec))
        bound = encoded_size_bound(numel, codec)
        if codec is Codec.SPARSE and not x.any():
            assert size == 5  # all zeros: the sparse form with no entries, far under the dense bound
            continue
        assert size <= bound <= size + BOUND_SLACK[codec], (size, bound)
        check_payload_size(size, numel, codec)  # what an honest sender declares passes


def test_sparse_vectors_stay_under_the_sparse_bound():
    x = torch.zeros(10_000)
    x[torch.randperm(10_000, generator=torch.Generator().manual_seed(0))[:100]] = 1.5
    size = len(encode(x, Codec.SPARSE))
    assert size == 5 + 8 * 100 <= encoded_size_bound(10_000, Codec.SPARSE)
    check_payload_size(size, 10_000, Codec.SPARSE)


@pytest.mark.parametrize("codec", list(Codec))
def test_a_declared_size_beyond_the_bound_is_refused(codec):
    bound = encoded_size_bound(1000, codec)
    for declared in (bound + 1, 1 << 30):
        with pytest.raises(PeerProtocolError, match=f"{declared} bytes declared for 1000 values"):
            check_payload_size(declared, 1000, codec, peer="QmBad")
    if codec in (Codec.NONE, Codec.INT8):  # exact codecs: any other length too
        with pytest.raises(PeerProtocolError, match=f"expected {bound}$"):
            check_payload_size(bound - 1, 1000, codec)
    else:
        check_payload_size(bound - 1, 1000, codec)


def test_every_codec_has_a_bound_the_swarm_can_check_without_the_round():
    assert all(max_part_bytes(1000, codec.value) == encoded_size_bound(1000, codec) for codec in Codec)
    assert max_part_bytes(1000, "bogus") is None and max_part_bytes(-1, "none") is None
    # the part method's coarse limit, before the round is known: the largest part any codec can take
    assert MAX_PART_BYTES == encoded_size_bound(MAX_PART_NUMEL, Codec.SPARSE) < 1 << 34
