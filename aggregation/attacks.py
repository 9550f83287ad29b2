"""Gradient-level Byzantine attacks as pure functions, for tests, benchmarks and the simulator.

Each attack is ``attack(honest, b, *, generator, **params) -> (b, d)``: given the honest
rows (h, d) of this round it returns what the b Byzantine peers send (on honest's device
and dtype). The attackers are assumed to see the honest rows (omniscient, the worst case)
and to collude. Label flips and delayed (replayed) gradients act on data and time, not on
a round's rows, so they live in the simulator, not here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import torch
from torch import Tensor

from phalanx.aggregation.base import check_int, check_matrix, check_positive
from phalanx.aggregation.registry import Registry, check_params
from phalanx.errors import AggregationInputError

Attack = Callable[..., Tensor]  # (honest: (h, d), b: int, *, generator, **params) -> (b, d)

ATTACKS: Registry[Attack] = Registry("attack")


def register_attack(name: str) -> Callable[[Attack], Attack]:
    """Decorator: add an attack function to ATTACKS under ``name``."""
    return functools.partial(ATTACKS.register, name)


def make_attack(name: str, **params: Any) -> Callable[..., Tensor]:
    """The attack ``name`` with ``params`` bound: ``(honest, b, *, generator) -> (b, d)``."""
    fn = ATTACKS[name]
    check_params(f"attack {name!r}", fn, params, skip=2, runtime=("generator",))
    return functools.partial(fn, **params)


def _inputs(honest: Tensor, b: int) -> tuple[Tensor, int]:
    honest = check_matrix(honest, "honest")
    return honest, check_int("b", b, minimum=0)


def _randn(shape: tuple[int, ...], generator: torch.Generator, like: Tensor) -> Tensor:
    """Standard normal draws from ``generator`` (on its own device), moved to like's device/dtype."""
    return torch.randn(shape, generator=generator, device=generator.device, dtype=like.dtype).to(like.device)


@register_attack("sign_flip")
def sign_flip(honest: Tensor, b: int, *, generator: torch.Generator, scale: float = -1.0) -> Tensor:
    """Every Byzantine row is scale × the honest mean (scale −1 or −1000 in BTARD's experiments)."""
    honest, b = _inputs(honest, b)
    return (scale * honest.mean(dim=0)).expand(b, -1).clone()


def _direction_rows(honest: Tensor, b: int, generator: torch.Generator, norm_scale: float, shared: bool) -> Tensor:
    honest, b = _inputs(honest, b)
    norm_scale = check_positive("norm_scale", norm_scale)
    d = honest.shape[1]
    z = _randn((1 if shared else b, d), generator, honest)
    z = z / torch.linalg.vector_norm(z, dim=1, keepdim=True)
    target = norm_scale * float(torch.linalg.vector_norm(honest.mean(dim=0)))
    return (target * z).expand(b, -1).clone()


@register_attack("random_direction")
def random_direction(honest: Tensor, b: int, *, generator: torch.Generator, norm_scale: float = 1000.0) -> Tensor:
    """Each Byzantine row an independent random direction of norm norm_scale·‖honest mean‖."""
    return _direction_rows(honest, b, generator, norm_scale, shared=False)


@register_attack("constant_direction")
def constant_direction(honest: Tensor, b: int, *, generator: torch.Generator, norm_scale: float = 1000.0) -> Tensor:
    """All Byzantine rows the same random direction (a shared seed) of norm norm_scale·‖honest mean‖."""
    return _direction_rows(honest, b, generator, norm_scale, shared=True)


@register_attack("ipm")
def ipm(honest: Tensor, b: int, *, generator: torch.Generator, eps: float = 0.1) -> Tensor:
    """Inner-product manipulation (Xie et al.): −ε·(honest mean), ε ∈ {0.1, 0.5, 2} in the literature."""
    honest, b = _inputs(honest, b)
    eps = check_positive("eps", eps)
    return (-eps * honest.mean(dim=0)).expand(b, -1).clone()


def alie_z(n: int, b: int) -> float:
    """z of "A Little Is Enough" (Baruch et al., 2019) for n peers of which b are Byzantine.

    s = ⌊n/2 + 1⌋ − b honest peers must be won over; z = Φ⁻¹((n − s)/n), the largest shift
    (in standard deviations) that still leaves the Byzantine values closer to the mean
    than s honest ones. Small b gives z <= 0 (no shift helps); b > n/2 is no longer ALIE.
    """
    n, b = check_int("n", n, minimum=1), check_int("b", b, minimum=0)
    s = math.floor(n / 2 + 1) - b
    if not 0 < s < n or b > n / 2:
        raise AggregationInputError(f"alie_z needs 0 <= b <= n/2 and n > 1, got n={n} and b={b}")
    return NormalDist().inv_cdf((n - s) / n)


@register_attack("alie")
def alie(honest: Tensor, b: int, *, generator: torch.Generator, z: float | None = None) -> Tensor:
    """A Little Is Enough: μ − z·σ per coordinate (μ, σ: mean and unbiased std of the honest rows).

    z: default alie_z(h + b, b); the literature also uses a fixed 1.5.
    """
    honest, b = _inputs(honest, b)
    if z is None:
        z = alie_z(honest.shape[0] + b, b)
    elif isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z):
        raise AggregationInputError(f"z must be a finite number, got {z!r}")
    mu = honest.mean(dim=0)
    sigma = honest.std(dim=0, correction=1) if honest.shape[0] > 1 else torch.zeros_like(mu)
    return (mu - z * sigma).expand(b, -1).clone()


@register_attack("gaussian")
def gaussian(honest: Tensor, b: int, *, generator: torch.Generator, std: float = 200.0) -> Tensor:
    """Pure noise: every Byzantine row drawn from N(0, std²·I) (std 200 as in Xie et al.)."""
    honest, b = _inputs(honest, b)
    return check_positive("std", std) * _randn((b, honest.shape[1]), generator, honest)


@register_attack("nan")
def nan(honest: Tensor, b: int, *, generator: torch.Generator) -> Tensor:
    """Rows full of NaN: aggregators must exclude them, never average them in."""
    honest, b = _inputs(honest, b)
    return torch.full((b, honest.shape[1]), math.nan, dtype=honest.dtype, device=honest.device)


@register_attack("inf")
def inf(honest: Tensor, b: int, *, generator: torch.Generator) -> Tensor:
    """Rows of alternating +Inf/−Inf (so both the max and the min side see infinities)."""
    honest, b = _inputs(honest, b)
    signs = torch.ones(honest.shape[1], dtype=honest.dtype, device=honest.device)
    signs[1::2] = -1
    return (math.inf * signs).expand(b, -1).clone()


def apply_attack(name: str, honest: Tensor, b: int, *, generator: torch.Generator, **params: Any) -> Tensor:
    """Honest rows followed by b attack rows: (h + b, d). Convenience for tests and benchmarks."""
    bad = make_attack(name, **params)(honest, b, generator=generator)
    return torch.cat([honest, bad], dim=0)
