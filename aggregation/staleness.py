"""Staleness corrections for late contributions: SA, Gap-Aware and DC-ASGD (flat d-vectors).

A contribution computed at parameters θ_{t−τ} and applied at θ_t has staleness τ and gap
Δ = θ_t − θ_{t−τ}. SA divides by max(1, τ); Gap-Aware divides elementwise by how many
typical steps Δ spans, so it penalizes less when the intermediate steps cancel; DC-ASGD
adds a first-order Taylor correction instead of shrinking. DANA is in dana.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from phalanx.aggregation.base import check_nonnegative, check_positive
from phalanx.errors import AggregationInputError


def staleness_aware(g: Tensor, tau: float) -> Tensor:
    """SA-ASGD: g / max(1, τ) for a contribution τ updates old."""
    tau = check_nonnegative("tau", tau)
    return g / max(1.0, tau)


def dc_asgd(g: Tensor, delta: Tensor, lam: float = 0.04) -> Tensor:
    """DC-ASGD: g + λ·g⊙g⊙Δ, the gradient at θ_{t−τ} corrected towards θ_t (g⊙g approximates the Hessian)."""
    _same_shape(g, delta)
    lam = check_nonnegative("lam", lam)
    return g + lam * g * g * delta


class GapAware:
    """Gap-Aware penalty (Barkai, Hakimi & Schuster) with its running statistic as state.

    v: EMA (β = 0.999) of the squared unpenalized step, bias-corrected as v̂ = v / (1 − β^t).
    C = η_max·(√v̂ + 1e-8): the size of one typical parameter step at the largest learning
    rate η_max of the schedule, elementwise. Gap G = 1 + |Δ|/C elementwise (>= 1): roughly
    how many typical steps the parameters moved while the contribution was computed.
    ``correct`` divides the contribution (and weight decay with it) by G.

    Feed ``observe`` only the UNPENALIZED step (the momentum buffer as the raw gradient
    would make it, or the raw gradient without momentum). Feeding back the penalized step
    shrinks v, hence C, hence grows G: a loop that over-penalizes.

    What is guaranteed (and tested): G = 1 exactly when Δ = 0 (the plain update); if Δ is
    the sum of τ parameter steps each bounded elementwise by C, then G <= 1 + τ elementwise,
    i.e. GA never divides by more than SA's τ plus the one fresh step; and when the steps
    cancel so that |Δ| <= (τ − 1)·C, G <= τ = SA's divisor.
    """

    def __init__(self, lr_max: float, *, beta: float = 0.999, eps: float = 1e-8) -> None:
        self.lr_max = check_positive("lr_max", lr_max)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise AggregationInputError(f"beta must be a number in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self.eps = check_positive("eps", eps)
        self.v: Tensor | None = None  # (d,) EMA of the squared unpenalized step
        self.steps = 0

    def observe(self, unpenalized_step: Tensor) -> None:
        """Update v with one unpenalized step (never the penalized one; see the class docstring)."""
        if not bool(torch.isfinite(unpenalized_step).all()):
            raise AggregationInputError("unpenalized_step is not finite; GapAware would carry NaN forever")
        sq = unpenalized_step.square()
        if self.v is None:
            self.v = torch.zeros_like(sq)
        _same_shape(self.v, sq, names=("GapAware state", "unpenalized_step"))
        self.v.mul_(self.beta).add_(sq, alpha=1 - self.beta)
        self.steps += 1

    def threshold(self) -> Tensor:
        """C = η_max·(√v̂ + eps): (d,)."""
        if self.v is None:
            raise AggregationInputError("GapAware needs at least one observe() before a penalty: C is undefined")
        v_hat = self.v / (1 - math.pow(self.beta, self.steps))
        return self.lr_max * (v_hat.sqrt() + self.eps)

    def penalty(self, delta: Tensor) -> Tensor:
        """G = 1 + |Δ|/C elementwise: (d,), >= 1."""
        c = self.threshold()
        _same_shape(c, delta, names=("GapAware state", "delta"))
        return 1 + delta.abs() / c

    def correct(self, g: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(g / G, G): the penalized contribution and the gap used."""
        _same_shape(g, delta)
        gap = self.penalty(delta)
        return g / gap, gap


def _same_shape(a: Tensor, b: Tensor, names: tuple[str, str] = ("g", "delta")) -> None:
    if a.shape != b.shape:
        raise AggregationInputError(
            f"{names[0]} and {names[1]} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
