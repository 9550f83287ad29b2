"""Tensor bytes on the wire: raw float32, hivemind's fp16 / 8-bit codecs, int8 with per-block
scales (little-endian float32 scales, one per INT8_BLOCK values, then the int8 codes), or sparse
(top-k's vectors: one form byte, then either dense float32, or a uint32 count, that many uint32
indices strictly ascending and their float32 values; whichever is smaller, so it is lossless).

Decoding checks everything a peer controls (codec, dtype, shape, buffer size) against
what the round agreed on, so a bad payload is a PeerProtocolError, never a crash. Every
codec's size is bounded by the part's numel (encoded_size_bound, exact for raw float32 and
int8), and receivers hold a peer's declared length to it before allocating anything.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType, Tensor as TensorProto

from phalanx.aggregation.compression import INT8_BLOCK, int8_dequantize, int8_error_bound, int8_quantize
from phalanx.errors import PeerProtocolError
from phalanx.protocol.config import Codec
from phalanx.security.commitments import EXACT_SIZE_CODECS, max_part_bytes


_HIVEMIND = {Codec.FP16: CompressionType.FLOAT16, Codec.UINT8: CompressionType.UNIFORM_8BIT}


def encode(vector: torch.Tensor, codec: Codec) -> bytes | memoryview:
    """Bytes for a 1-d tensor; for NONE a view that borrows the tensor's memory (keep it alive)."""
    vector = vector.detach().to("cpu", torch.float32).contiguous().view(-1)
    if codec is Codec.NONE:
        return memoryview(vector.numpy()).cast("B")
    if codec is Codec.INT8:
        codes, scales = int8_quantize(vector)
        return scales.numpy().tobytes() + codes.numpy().tobytes()
    if codec is Codec.SPARSE:
        return _encode_sparse(vector)
    return serialize_torch_tensor(vector, _HIVEMIND[codec]).SerializeToString()


FP16_UNIT_ROUNDOFF = 2.0**-11  # round to nearest, normal range
FP16_SUBNORMAL_HALF_STEP = 2.0**-25


def rounding_bound(decoded: torch.Tensor, codec: Codec) -> float:
    """A bound on ‖v − decoded‖ for any float32 v (within the codec's range) whose encoding decodes to
    `decoded`: what a reducer's honest aggregate may lose on the way to the others. Verified rounds
    widen their fixed-point tolerance by it. 8-bit codebooks have no such bound (outliers land in the
    edge buckets), so verified rounds refuse them."""
    if codec in (Codec.NONE, Codec.SPARSE):
        return 0.0
    if codec is Codec.INT8:
        return int8_error_bound(decoded)
    if codec is Codec.FP16:
        norm = float(torch.linalg.vector_norm(decoded.double()))
        slack = FP16_UNIT_ROUNDOFF * norm + FP16_SUBNORMAL_HALF_STEP * math.sqrt(decoded.numel())
        return slack / (1.0 - FP16_UNIT_ROUNDOFF)
    raise ValueError(f"no rounding bound for the {codec.value} codec")


# hivemind's Tensor shapes are uint32: no part holds more values, and no part's bytes exceed the largest
# codec's bound for it (sparse's dense form: 16 GiB). The transport's limit before a part's round is known.
MAX_PART_NUMEL = (1 << 32) - 1


def encoded_size_bound(numel: int, codec: Codec) -> int:
    """The most bytes encode() writes for `numel` values (security.commitments.max_part_bytes): the limit
    a part or an aggregate is received under, checked before a byte of it is allocated."""
    bound = max_part_bytes(numel, codec.value)
    if bound is None:
        raise ValueError(f"no size bound for {numel} values of {codec.value}")
    return bound


def exact_size(codec: Codec) -> bool:
    """Whether every encoding of n values takes exactly encoded_size_bound(n) bytes (raw float32, int8)."""
    return codec.value in EXACT_SIZE_CODECS


def check_payload_size(length: int, numel: int, codec: Codec, *, peer: str | None = None) -> None:
    """Refuse (PeerProtocolError) a declared payload that no encoding of `numel` values in `codec` takes,
    before it is read: a length the peer states is allocated as stated."""
    bound = encoded_size_bound(numel, codec)
    if length > bound or (exact_size(codec) and length != bound):
        expected = f"{bound}" if exact_size(codec) else f"at most {bound}"
        raise PeerProtocolError(
            f"{length} bytes declared for {numel} values of {codec.value}, expected {expected}", peer=peer
        )


def decode(data: bytes | bytearray | memoryview, codec: Codec, numel: int, *, peer: str | None = None) -> torch.Tensor:
    """Inverse of encode(); raises PeerProtocolError unless `data` is exactly a `numel` float vector."""
    if codec is Codec.NONE:
        if len(data) != 4 * numel:
            raise PeerProtocolError(f"expected {4 * numel} bytes of float32, got {len(data)}", peer=peer)
        if numel == 0:
            return torch.zeros(0)
        return torch.frombuffer(data, dtype=torch.float32)
    if codec is Codec.INT8:
        return _decode_int8(data, numel, peer)
    if codec is Codec.SPARSE:
        return _decode_sparse(data, numel, peer)
    try:
        proto = TensorProto.FromString(bytes(data))
    except Exception as e:
        raise PeerProtocolError(f"undecodable tensor: {type(e).__name__}", peer=peer) from None
    if proto.compression != _HIVEMIND[codec] or list(proto.size) != [numel] or proto.dtype != "float32":
        raise PeerProtocolError(
            f"tensor header says compression={proto.compression} size={list(proto.size)[:4]} dtype={proto.dtype[:16]!r},"
            f" expected {codec.value} [{numel}] float32",
            peer=peer,
        )
    if len(proto.buffer) > encoded_size_bound(numel, codec):
        raise PeerProtocolError(f"tensor buffer of {len(proto.buffer)} bytes is too large", peer=peer)
    try:
        tensor = deserialize_torch_tensor(proto)
    except Exception as e:
        raise PeerProtocolError(f"malformed {codec.value} tensor: {type(e).__name__}", peer=peer) from None
    if tensor.numel() != numel:
        raise PeerProtocolError(f"tensor has {tensor.numel()} elements, expected {numel}", peer=peer)
    return tensor.reshape(-1).to(torch.float32)


def _decode_int8(data: bytes | bytearray | memoryview, numel: int, peer: str | None) -> torch.Tensor:
    expected = encoded_size_bound(numel, Codec.INT8)
    if len(data) != expected:
        raise PeerProtocolError(f"expected {expected} bytes of int8 codes and scales for {numel} values, got {len(data)}", peer=peer)
    if numel == 0:
        return torch.zeros(0)
    blocks = -(-numel // INT8_BLOCK)
    raw = bytearray(data)
    scales = torch.frombuffer(raw, dtype=torch.float32, count=blocks)
    if bool((scales < 0).any()):
        raise PeerProtocolError("int8 block scale is negative (an absmax never is)", peer=peer)
    codes = torch.frombuffer(raw, dtype=torch.int8, offset=4 * blocks)
    if bool((codes == -128).any()):
        raise PeerProtocolError("int8 code -128 is outside the codec's range [-127, 127]", peer=peer)
    return int8_dequantize(codes, scales)


_DENSE, _SPARSE = 0, 1


def _encode_sparse(vector: torch.Tensor) -> bytes:
    indices = torch.nonzero(vector, as_tuple=True)[0]
    nnz = indices.numel()
    if 4 + 8 * nnz >= 4 * vector.numel():
        return bytes([_DENSE]) + vector.numpy().tobytes()
    head = bytes([_SPARSE]) + np.uint32(nnz).tobytes()
    return head + indices.numpy().astype("<u4").tobytes() + vector[indices].numpy().tobytes()


def _decode_sparse(data: bytes | bytearray | memoryview, numel: int, peer: str | None) -> torch.Tensor:
    raw = bytes(data)
    if not raw or raw[0] not in (_DENSE, _SPARSE):
        raise PeerProtocolError("sparse tensor: unknown form byte", peer=peer)
    if raw[0] == _DENSE:
        if len(raw) != 1 + 4 * numel:
            raise PeerProtocolError(f"expected {1 + 4 * numel} bytes of dense float32, got {len(raw)}", peer=peer)
        return torch.from_numpy(np.frombuffer(raw, dtype="<f4", offset=1).copy())
    if len(raw) < 5:
        raise PeerProtocolError("sparse tensor: no count", peer=peer)
    nnz = int(np.frombuffer(raw, dtype="<u4", count=1, offset=1)[0])
    if 4 + 8 * nnz >= 4 * numel or len(raw) != 5 + 8 * nnz:
        raise PeerProtocolError(f"sparse tensor of {nnz} entries for {numel} values in {len(raw)} bytes", peer=peer)
    indices = torch.from_numpy(np.frombuffer(raw, dtype="<u4", count=nnz, offset=5).astype(np.int64))
    if nnz and (int(indices[-1]) >= numel or bool((indices[1:] <= indices[:-1]).any())):
        raise PeerProtocolError("sparse tensor: indices out of range or not strictly ascending", peer=peer)
    out = torch.zeros(numel, dtype=torch.float32)
    out[indices] = torch.from_numpy(np.frombuffer(raw, dtype="<f4", count=nnz, offset=5 + 4 * nnz).copy())
    return out
