"""int8 with per-block scales (its strict bound, its wire format) and top-k with error feedback."""

import math

import pytest
import torch

from phalanx.aggregation.compression import (
    INT8_BLOCK,
    INT8_ERROR_FACTOR,
    INT8_ERROR_FLOOR,
    ErrorFeedback,
    int8_dequantize,
    int8_error_bound,
    int8_quantize,
    sparse_to_dense,
    topk_select,
)
from phalanx.errors import PeerProtocolError
from phalanx.protocol.codec import decode, encode, encoded_size_bound, rounding_bound
from phalanx.protocol.config import Codec


def _inputs():
    g = torch.Generator().manual_seed(0)
    yield "gaussian", torch.randn(10_000, generator=g)
    yield "one huge outlier", torch.cat([torch.randn(1000, generator=g) * 1e-3, torch.tensor([1e30]), torch.randn(300, generator=g)])
    yield "near float32 max", torch.tensor([3.4e38, -3.4e38, 1.0, 0.0] * 100)
    yield "subnormal", torch.randn(1000, generator=g) * 1e-42
    yield "zeros and a ragged tail", torch.cat([torch.zeros(INT8_BLOCK), torch.randn(INT8_BLOCK + 7, generator=g)])
    yield "heavy tails", torch.randn(5000, generator=g) ** 5
    yield "half-way values", torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] * 50)


@pytest.mark.parametrize(("name", "x"), list(_inputs()))
def test_int8_error_is_within_half_a_scale_step_per_element_and_the_norm_bound(name, x):
    codes, scales = int8_quantize(x)
    decoded = int8_dequantize(codes, scales)
    per_block = torch.repeat_interleave(scales.double(), INT8_BLOCK)[: x.numel()]
    error = (x.double() - decoded.double()).abs()
    assert bool((error <= per_block * INT8_ERROR_FACTOR + INT8_ERROR_FLOOR).all()), (name, float((error / per_block.clamp_min(1e-300)).max()))
    assert float(error.norm()) <= int8_error_bound(decoded), name
    again = int8_quantize(x)  # deterministic: the same bytes every time
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)


def test_int8_wire_round_trip_and_size():
    x = torch.randn(1000)
    payload = encode(x, Codec.INT8)
    assert len(payload) == encoded_size_bound(1000, Codec.INT8) == 4 * math.ceil(1000 / INT8_BLOCK) + 1000
    decoded = decode(payload, Codec.INT8, 1000)
    assert float((decoded - x).norm()) <= rounding_bound(decoded, Codec.INT8)
    assert torch.equal(decoded, int8_dequantize(*int8_quantize(x)))


def test_int8_decoding_refuses_what_no_encoder_produces():
    payload = bytearray(encode(torch.randn(300), Codec.INT8))
    with pytest.raises(PeerProtocolError, match="expected 308 bytes"):
        decode(payload[:-1], Codec.INT8, 300)
    bad_scale = bytearray(payload)
    bad_scale[0:4] = torch.tensor([-1.0]).numpy().tobytes()
    with pytest.raises(PeerProtocolError, match="scale is negative"):
        decode(bad_scale, Codec.INT8, 300)
    bad_code = bytearray(payload)
    bad_code[8] = 0x80  # -128
    with pytest.raises(PeerProtocolError, match="outside the codec's range"):
        decode(bad_code, Codec.INT8, 300)


def test_a_non_finite_block_decodes_non_finite_so_aggregators_exclude_the_row():
    x = torch.randn(600)
    x[300] = float("nan")
    decoded = decode(encode(x, Codec.INT8), Codec.INT8, 600)
    assert not torch.isfinite(decoded[256:512]).all() and torch.isfinite(decoded[:256]).all()


def test_topk_takes_the_largest_magnitudes_in_index_order():
    x = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0])
    indices, values = topk_select(x, 2 / 6)
    assert indices.tolist() == [1, 3] and values.tolist() == [-5.0, 4.0]
    with pytest.raises(ValueError):
        topk_select(x, 0.0)


def test_error_feedback_sends_plus_residual_is_exactly_what_was_contributed():
    g = torch.Generator().manual_seed(1)
    feedback = ErrorFeedback(5000, fraction=0.01)
    contributed = torch.zeros(5000, dtype=torch.float64)
    sent = torch.zeros(5000, dtype=torch.float64)
    for _ in range(40):
        delta = torch.randint(-2**10, 2**10, (5000,), generator=g).float() / 2**10  # dyadic: float sums are exact
        contributed += delta.double()
        indices, values = feedback.compress(delta)
        assert len(indices) == 50
        sent += sparse_to_dense(indices, values, 5000).double()
    assert torch.equal(sent + feedback.residual.double(), contributed)
    assert float(feedback.residual.abs().max()) < float(contributed.abs().max())  # it does send the big ones


@pytest.mark.parametrize("nonzero", [0, 1, 37, 499, 500, 1000])
def test_sparse_wire_is_lossless_and_takes_the_smaller_form(nonzero):
    g = torch.Generator().manual_seed(nonzero)
    x = torch.zeros(1000)
    x[torch.randperm(1000, generator=g)[:nonzero]] = torch.randn(nonzero, generator=g)
    data = encode(x, Codec.SPARSE)
    assert torch.equal(decode(bytearray(data), Codec.SPARSE, 1000), x)
    assert len(data) == (5 + 8 * nonzero if 4 + 8 * nonzero < 4000 else 4001)
    assert len(data) <= encoded_size_bound(1000, Codec.SPARSE)


def test_sparse_decoding_refuses_what_no_encoder_produces():
    import numpy as np

    def sparse(indices, values, count=None):
        n = len(indices) if count is None else count
        return bytes([1]) + np.uint32(n).tobytes() + np.array(indices, "<u4").tobytes() + np.array(values, "<f4").tobytes()

    cases = {
        b"": "unknown form byte",
        b"\x07" + b"\x00" * 40: "unknown form byte",
        b"\x00" + b"\x00" * 36: "expected 41 bytes of dense float32",
        sparse([1, 5], [1.0, 2.0], count=3): "sparse tensor of 3 entries",
        sparse([5, 1], [1.0, 2.0]): "not strictly ascending",
        sparse([1, 1], [1.0, 2.0]): "not strictly ascending",
        sparse([1, 10], [1.0, 2.0]): "out of range",
        sparse(list(range(5)), [1.0] * 5): "sparse tensor of 5 entries for 10 values",  # the dense form is smaller
    }
    for data, error in cases.items():
        with pytest.raises(PeerProtocolError, match=error):
            decode(data, Codec.SPARSE, 10, peer="QmBad")
