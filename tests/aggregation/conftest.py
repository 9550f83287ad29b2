"""Shared fixtures for aggregation tests: the device parameter and seeded honest inputs."""

from __future__ import annotations

import pytest
import torch

CUDA_SKIP = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA NOT AVAILABLE: the cuda variants of the aggregator tests did not run on this machine",
)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=CUDA_SKIP)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every aggregator test runs on CPU, and on CUDA when there is one."""
    return torch.device(request.param)


@pytest.fixture
def make_honest():
    """Factory fixture: make_honest(h, d, seed=..., spread=..., offset=...) -> (h, d) float64 rows."""
    return honest_rows


def honest_rows(
    h: int, d: int, *, seed: int, spread: float = 1.0, offset: float = 0.0, dtype=torch.float64
) -> torch.Tensor:
    """(h, d) rows μ + noise with ‖noise_i‖ ≈ spread and ‖μ‖ ≈ offset·spread (seeded)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(d, generator=g, dtype=dtype) * (offset * spread / d**0.5)
    return mu + torch.randn(h, d, generator=g, dtype=dtype) * (spread / d**0.5)
