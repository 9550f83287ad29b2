"""The contract every aggregator shares: input checks, the non-finite-row rule and the result type.

Rule for bad rows: a row with a NaN or Inf, or so large that its squared norm would
overflow the dtype, counts as Byzantine. It is dropped before aggregation and reported in
``AggregateResult.excluded``; if no row is left, ``AggregationInputError`` is raised, so an
aggregator never returns a silent NaN. Everything else that is wrong raises with a message
that names the argument and the fix.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from phalanx.errors import AggregationInputError

logger = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class AggregateResult:
    """What an aggregator returns.

    value: (d,) aggregate, on the input's device and dtype.
    iterations: iterations of an iterative rule (1 for one-shot rules).
    residual: how far the returned point is from the rule's fixed point, in the units of
        the input (0.0 for one-shot rules); each rule documents its definition.
    excluded: indices of input rows dropped as non-finite (see the module docstring).
    """

    value: Tensor
    iterations: int = 1
    residual: float = 0.0
    excluded: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rows:
    """Validated input: the rows that take part and their weights.

    x: (m, d) kept rows; the caller's tensor itself (no copy) when nothing was dropped.
    weights: (m,) on x's device and dtype, or None when all kept rows weigh the same.
    norms: (m,) L2 norm of each kept row (the check pass computes them anyway).
    excluded: indices into the caller's rows that were dropped as non-finite.
    """

    x: Tensor
    weights: Tensor | None
    norms: Tensor
    excluded: tuple[int, ...]

    @property
    def n(self) -> int:
        return self.x.shape[0]


def norm_limit(dtype: torch.dtype) -> float:
    """Largest row norm we accept: a quarter of sqrt(max), so centered Gram entries never overflow.

    About 4.6e18 in float32 and 3.4e153 in float64; no honest gradient comes near either.
    """
    return math.sqrt(torch.finfo(dtype).max) / 4


def check_matrix(x: object, name: str = "x") -> Tensor:
    """Check that ``x`` is a non-empty (n, d) float32/float64 tensor and return it."""
    if not isinstance(x, Tensor):
        raise AggregationInputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise AggregationInputError(f"{name} must be a 2-D (n, d) tensor, got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise AggregationInputError(f"{name} is empty (shape {tuple(x.shape)}); need at least one row and one column")
    if x.dtype not in FLOAT_DTYPES:
        raise AggregationInputError(f"{name} must be float32 or float64, got {x.dtype}; convert with .float()")
    return x


def check_vector(v: object, x: Tensor, name: str) -> Tensor:
    """Check that ``v`` is a finite (d,) vector matching ``x`` and return it on x's device and dtype."""
    d = x.shape[1]
    if not isinstance(v, Tensor):
        raise AggregationInputError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if tuple(v.shape) != (d,):
        raise AggregationInputError(f"{name} must have shape (d,) = ({d},), got {tuple(v.shape)}")
    v = v.to(device=x.device, dtype=x.dtype)
    if not bool(torch.isfinite(v).all()):
        raise AggregationInputError(f"{name} must be finite, got NaN or Inf")
    return v


def check_weights(weights: object, n: int, like: Tensor) -> Tensor | None:
    """Check per-row weights: (n,), finite, >= 0, positive sum. Returns them on like's device/dtype."""
    if weights is None:
        return None
    if not isinstance(weights, Tensor):
        raise AggregationInputError(f"weights must be a torch.Tensor or None, got {type(weights).__name__}")
    if tuple(weights.shape) != (n,):
        raise AggregationInputError(f"weights must have shape (n,) = ({n},), got {tuple(weights.shape)}")
    w = weights.to(device=like.device, dtype=like.dtype)
    if not bool(torch.isfinite(w).all()):
        raise AggregationInputError("weights must be finite, got NaN or Inf")
    if bool((w < 0).any()):
        raise AggregationInputError(f"weights must be >= 0, got a minimum of {float(w.min())}")
    if not bool((w > 0).any()):
        raise AggregationInputError("weights are all zero; give at least one row a positive weight")
    return w


def prepare(x: object, weights: object = None, *, drop_zero_weight: bool = False) -> Rows:
    """Validate ``x`` and ``weights`` and drop non-finite rows (and zero-weight rows if asked).

    One read of x: the row norms, which find NaN/Inf (they propagate) and overflow alike.
    Rows are copied only when some are dropped.
    """
    x = check_matrix(x)
    n = x.shape[0]
    w = check_weights(weights, n, x)
    norms = torch.linalg.vector_norm(x, dim=1)  # (n,); NaN/Inf rows give NaN/Inf
    bad = ~(norms <= norm_limit(x.dtype))  # NaN compares False, so it lands in bad
    keep = ~bad if w is None or not drop_zero_weight else ~bad & (w > 0)
    excluded: tuple[int, ...] = ()
    if bool(bad.any()):
        excluded = tuple(int(i) for i in bad.nonzero().flatten().tolist())
        logger.debug("excluding %d non-finite row(s) of %d: %s", len(excluded), n, excluded)
        if len(excluded) == n:
            raise AggregationInputError(
                f"all {n} rows of x are non-finite (NaN/Inf or norm above {norm_limit(x.dtype):.3g}); "
                "nothing is left to aggregate"
            )
    if not bool(keep.all()):
        x, norms = x[keep], norms[keep]  # copies the kept rows
        w = None if w is None else w[keep]
    if w is not None:
        if not bool((w > 0).any()):
            raise AggregationInputError(
                f"the rows left after excluding non-finite rows {list(excluded)} all have weight 0; "
                "nothing is left to aggregate"
            )
        if bool(w.min() == w.max()):
            w = None  # uniform: let rules take their unweighted fast path
    return Rows(x=x, weights=w, norms=norms, excluded=excluded)


def effective_b(b: int, excluded: tuple[int, ...]) -> int:
    """Byzantine budget left after dropping rows: each excluded row is a Byzantine peer already found."""
    return max(0, b - len(excluded))


def excluded_note(excluded: tuple[int, ...], b: int) -> str:
    """Text for error messages that explains how excluded rows changed n and b."""
    if not excluded:
        return ""
    k = len(excluded)
    return f" (after excluding {k} non-finite row{'s' if k > 1 else ''}, which count against b={b})"


# ---- parameter checks shared by the functions and the registry factories -------------


def check_positive(name: str, value: object, *, allow_inf: bool = False, hint: str = "") -> float:
    """A float > 0 (inf allowed only where it means something, e.g. tau)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AggregationInputError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not (v > 0) or (math.isinf(v) and not allow_inf):
        extra = f" ({hint})" if hint else ""
        raise AggregationInputError(
            f"{name} must be a positive{'' if allow_inf else ' finite'} number{extra}, got {value!r}"
        )
    return v


def check_nonnegative(name: str, value: object) -> float:
    """A finite float >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= float(value) < math.inf):
        raise AggregationInputError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_int(name: str, value: object, *, minimum: int) -> int:
    """An int >= minimum; integral floats (2.0, as config parsers give) pass, bools do not (a typo, not 1)."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < minimum:  # type: ignore[operator]
        raise AggregationInputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)  # type: ignore[arg-type]
