"""Lossy compression of what peers send, as tensor math (the bytes are protocol/codec.py's).

int8 with a per-block absmax scale: blocks of INT8_BLOCK values, s = max|x| / 127, q = round(x / s)
(round half to even, deterministic), decoded as q·s. The error of every element is at most
s · INT8_ERROR_FACTOR, a strict bound that verified rounds widen their checks by.

Top-k with error feedback: the residual e takes each contribution Δ (e ← e + Δ), the k largest |e|
are sent with their indices (C(e)), and e ← e − C(e), which is exactly 0 where something was sent.
So everything sent plus the residual is everything contributed, with no other rounding.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

INT8_BLOCK = 256  # values per scale: 4 bytes of scale per 256 bytes of codes (1.6 % overhead)
# |x − q·s| ≤ s/2 from rounding, plus float32 rounding of x/s and of q·s (each ≤ 2^-24 of a value ≤ 128 s)
INT8_ERROR_FACTOR = 0.5 + 2.0**-16
INT8_ERROR_FLOOR = 2.0**-140  # absolute slack per element: subnormal s and q·s move in steps of 2^-149, and s of a
# block whose absmax is under 127·2^-149 is not representable at all (error ≤ absmax < 2^-142 there)


def int8_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """(codes (n,) int8, scales (⌈n / INT8_BLOCK⌉,) float32) of a 1-d float tensor. A block holding
    NaN or ±inf gets a NaN/inf scale, so it decodes non-finite and aggregators exclude the row."""
    x = x.detach().to(torch.float32).reshape(-1)
    n = x.numel()
    blocks = -(-n // INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    padded = padded.view(blocks, INT8_BLOCK)
    scales = padded.abs().amax(dim=1) / 127.0  # (blocks,)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / divisor[:, None]).clamp_(-127, 127).nan_to_num_(0.0).to(torch.int8)
    return codes.reshape(-1)[:n].clone(), scales


def int8_dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """The float32 values (n,) that `codes` (n,) int8 and `scales` stand for."""
    n = codes.numel()
    blocks = scales.numel()
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32, device=codes.device)
    padded[:n] = codes.to(torch.float32)
    return (padded.view(blocks, INT8_BLOCK) * scales[:, None]).reshape(-1)[:n].clone()


def int8_error_bound(decoded: Tensor) -> float:
    """A bound on ‖x − decoded‖₂ for any x whose int8 encoding decodes to `decoded` (n,): each block's
    scale is its decoded absmax / 127 (the absmax element codes to ±127), each element within
    s · INT8_ERROR_FACTOR + INT8_ERROR_FLOOR of x."""
    n = decoded.numel()
    if n == 0:
        return 0.0
    blocks = -(-n // INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float64)
    padded[:n] = decoded.detach().to("cpu", torch.float64).reshape(-1)
    scales = padded.view(blocks, INT8_BLOCK).abs().amax(dim=1) / 127.0 * (1 + 2.0**-20)  # decoded absmax ≈ 127 s
    sizes = torch.full((blocks,), float(INT8_BLOCK), dtype=torch.float64)
    sizes[-1] = n - (blocks - 1) * INT8_BLOCK
    return math.sqrt(float((sizes * (scales * INT8_ERROR_FACTOR + INT8_ERROR_FLOOR) ** 2).sum()))


def topk_select(x: Tensor, fraction: float) -> tuple[Tensor, Tensor]:
    """(indices ascending (k,) int64, values (k,)) of the k = ⌈fraction·n⌉ largest |x| (at least 1)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
    n = x.numel()
    k = min(n, max(1, math.ceil(fraction * n)))
    indices = torch.sort(x.abs().topk(k, sorted=False).indices).values
    return indices, x[indices]


class ErrorFeedback:
    """One peer's residual for top-k: what it contributed but has not sent yet."""

    def __init__(self, numel: int, fraction: float, device: torch.device | str = "cpu") -> None:
        self.fraction = fraction
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        self._before: Optional[Tensor] = None  # the residual before the send in flight took from it

    def send(self, contribution: Tensor) -> Tensor:
        """What to send for `contribution`, dense: the k largest entries of residual + contribution, zeros
        elsewhere. Until `delivered` or `give_back`, the residual before it is kept."""
        self._before = self.residual.clone()
        indices, values = self.compress(contribution)
        return sparse_to_dense(indices, values, contribution.numel())

    def give_back(self) -> None:
        """The send in flight delivered nothing: the residual is as before it (the next contribution covers
        the same progress again)."""
        if self._before is not None:
            self.residual.copy_(self._before)
        self._before = None

    def delivered(self) -> None:
        self._before = None

    def compress(self, contribution: Tensor) -> tuple[Tensor, Tensor]:
        """Add `contribution` (numel,) to the residual and take the k largest entries out of it:
        (indices, values) to send; the residual keeps the rest."""
        self.residual += contribution.reshape(-1)
        indices, values = topk_select(self.residual, self.fraction)
        values = values.clone()
        self.residual[indices] = 0.0  # e − C(e): exactly zero where sent
        return indices, values


def sparse_to_dense(indices: Tensor, values: Tensor, numel: int) -> Tensor:
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out[indices] = values.to(torch.float32)
    return out
