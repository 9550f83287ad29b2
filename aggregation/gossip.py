"""ClippedGossip (He, Karimireddy & Jaggi): robust gossip averaging for one node.

Update of node i: x_i ← x_i + Σ_j W_ij clip(x_j − x_i, τ_i), clip(z, τ) = z·min(1, τ/‖z‖),
which is Σ_j W_ij (x_i + clip(x_j − x_i, τ_i)) for a mixing row that sums to 1 (the self
term clips to zero). A Byzantine neighbour moves x_i by at most W_ij·τ_i, however far it is.
Non-finite neighbours are excluded (their weight stays with x_i).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from phalanx.aggregation.base import AggregateResult, Rows, check_positive, prepare
from phalanx.aggregation.span import row_sq_dists
from phalanx.errors import AggregationInputError

_WEIGHT_SUM_SLACK = 1e-6  # rounding allowance when the neighbour weights sum to exactly 1


def clipped_gossip_update(x_i: Tensor, neighbours: Tensor, weights: Tensor, tau: float) -> AggregateResult:
    """One ClippedGossip step for node i: the new x_i, (d,).

    x_i: (d,) this node's vector (must be finite: it is ours). neighbours: (m, d) received
    vectors. weights: (m,) mixing weights W_ij >= 0 with Σ_j W_ij <= 1 (the rest is the
    self weight). tau: clipping radius τ_i (inf gives plain gossip); see adaptive_gossip_tau.
    """
    tau = check_positive("tau", tau, allow_inf=True, hint="inf gives plain gossip averaging")
    x_i, rows, w = _check(x_i, neighbours, weights)
    dist = row_sq_dists(rows.x, x_i).sqrt_()  # exact ‖x_j − x_i‖, float64
    clip = torch.where(dist > 0, (tau / dist).clamp_(max=1.0), torch.ones_like(dist))
    coef = (w * clip).to(x_i.dtype)  # (m,)
    # x_i + Σ c_j (x_j − x_i) = (1 − Σ c_j)·x_i + cᵀX: one read of the neighbours
    value = coef @ rows.x + (1.0 - float(coef.sum())) * x_i
    return AggregateResult(value, excluded=rows.excluded)


def adaptive_gossip_tau(x_i: Tensor, neighbours: Tensor, weights: Tensor, *, delta: float) -> float:
    """τ_i from neighbour distances, following the adaptive rule of He, Karimireddy & Jaggi.

    delta: the total mixing weight that may belong to Byzantine neighbours (0 <= delta < 1).
    Rule: sort neighbours by distance; keep the closest ones whose cumulative weight stays
    within (1 − delta)·Σ_j W_ij; τ_i = sqrt(Σ_kept W_ij ‖x_j − x_i‖² / delta).
    Why: honest neighbours at a typical distance are then rarely clipped, while the
    Byzantine ones can move x_i by at most delta·τ_i = sqrt(delta·Σ_kept W_ij‖x_j − x_i‖²),
    which vanishes with the honest disagreement. delta = 0 gives inf (plain gossip).
    """
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta < 1:
        raise AggregationInputError(f"delta must be a number in [0, 1), got {delta!r}")
    if delta == 0:
        return math.inf
    x_i, rows, w = _check(x_i, neighbours, weights)
    sq = row_sq_dists(rows.x, x_i)  # (m,) float64
    order = torch.argsort(sq)
    cum = torch.cumsum(w[order], dim=0)
    kept = order[cum <= (1 - delta) * w.sum() * (1 + 1e-12)]
    return float(torch.sqrt((w[kept] * sq[kept]).sum() / (delta * w.sum())))


def _check(x_i: Tensor, neighbours: Tensor, weights: Tensor) -> tuple[Tensor, Rows, Tensor]:
    """Validate a gossip step's inputs.

    Returns x_i on the neighbours' device and dtype, the finite neighbour rows, and their
    weights as float64 (m,).
    """
    if not isinstance(weights, Tensor):
        raise AggregationInputError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    rows = prepare(neighbours, weights)
    if not isinstance(x_i, Tensor) or tuple(x_i.shape) != (neighbours.shape[1],):
        shape = tuple(x_i.shape) if isinstance(x_i, Tensor) else type(x_i).__name__
        raise AggregationInputError(f"x_i must be a (d,) = ({neighbours.shape[1]},) tensor, got {shape}")
    if not bool(torch.isfinite(x_i).all()):
        raise AggregationInputError("x_i (this node's own vector) is not finite; fix the local state first")
    total = float(weights.sum())
    if total > 1 + _WEIGHT_SUM_SLACK:
        raise AggregationInputError(
            f"neighbour weights sum to {total:.6g}; a mixing row's neighbour weights must sum to at most 1 "
            "(the rest is the self weight W_ii)"
        )
    keep = torch.ones(neighbours.shape[0], dtype=torch.bool)
    keep[list(rows.excluded)] = False
    w = weights.to(device=neighbours.device, dtype=torch.float64)[keep.to(neighbours.device)]
    return x_i.to(device=neighbours.device, dtype=neighbours.dtype), rows, w
