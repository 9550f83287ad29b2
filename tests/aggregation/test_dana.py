"""DANA (aggregation/dana.py): DANA-Slim equals DANA-Zero over random asynchronous schedules."""

from __future__ import annotations

import random

import pytest
import torch

from phalanx.aggregation.dana import AsgdMaster, DanaSlimWorker, DanaZero
from phalanx.aggregation.staleness import GapAware
from phalanx.errors import AggregationInputError

D = 16


def quadratic(seed: int):
    """Deterministic gradient of f(θ) = ½θᵀAθ − bᵀθ (A symmetric positive definite)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(D, D, generator=g, dtype=torch.float64)
    a = m @ m.T / D + torch.eye(D, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64)
    return lambda theta: a @ theta - b


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("workers", [2, 5, 16])
def test_slim_equals_zero_on_random_schedules(seed, workers):
    grad = quadratic(seed)
    theta0 = torch.randn(D, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + seed))
    zero = DanaZero(theta0, workers, lr=0.05, momentum=0.9)
    master = AsgdMaster(theta0, lr=0.05)
    slim = [DanaSlimWorker(theta0, momentum=0.9) for _ in range(workers)]
    held_zero: dict[int, torch.Tensor] = {}
    held_slim: dict[int, torch.Tensor] = {}
    rng = random.Random(seed)
    for _ in range(40 * workers):
        k = rng.randrange(workers)
        if k not in held_zero:  # k reads (again) now
            held_zero[k], held_slim[k] = zero.read(k), master.read()
            torch.testing.assert_close(held_slim[k], held_zero[k], rtol=0, atol=1e-10)
        else:  # k finishes its gradient on what it read, possibly many writes ago
            zero.write(k, grad(held_zero.pop(k)))
            master.write(slim[k].update(grad(held_slim.pop(k))))
        torch.testing.assert_close(master.theta, zero.look_ahead(), rtol=0, atol=1e-10)
    for k in range(workers):
        torch.testing.assert_close(slim[k].v, zero.velocities[k], rtol=0, atol=1e-10)
    # and Zero's own θ is recoverable from Slim: θ = Θ + ηγ Σ_k v^k
    recovered = master.theta + 0.05 * 0.9 * sum(w.v for w in slim)
    torch.testing.assert_close(recovered, zero.theta, rtol=0, atol=1e-10)


def test_dana_converges_on_a_quadratic():
    grad = quadratic(0)
    zero = DanaZero(torch.zeros(D, dtype=torch.float64), 4, lr=0.05, momentum=0.9)
    held = {k: zero.read(k) for k in range(4)}
    for step in range(2000):
        k = step % 4  # round-robin: every gradient is 3 writes stale
        zero.write(k, grad(held[k]))
        held[k] = zero.read(k)
    assert float(grad(zero.theta).norm()) < 1e-6


def test_dana_ga_with_fresh_reads_is_plain_dana():
    grad = quadratic(1)
    theta0 = torch.zeros(D, dtype=torch.float64)
    plain = DanaZero(theta0, 1, lr=0.05, momentum=0.9)
    ga = DanaZero(theta0, 1, lr=0.05, momentum=0.9, gap_aware=GapAware(lr_max=0.05))
    for _ in range(20):  # one worker that reads right before writing: Δ = 0, G = 1
        plain.write(0, grad(plain.read(0)))
        ga.write(0, grad(ga.read(0)))
    torch.testing.assert_close(ga.theta, plain.theta, rtol=0, atol=1e-12)


def test_dana_ga_penalizes_stale_gradients():
    grad = quadratic(2)
    ga = DanaZero(torch.zeros(D, dtype=torch.float64), 2, lr=0.05, momentum=0.9, gap_aware=GapAware(lr_max=0.05))
    stale = ga.read(1)
    for _ in range(10):
        ga.write(0, grad(ga.read(0)))
    before = ga.velocities[1].clone()
    ga.write(1, grad(stale))
    assert float(ga.velocities[1].norm()) < float(grad(stale).norm())  # divided by G > 1
    assert torch.equal(before, torch.zeros(D, dtype=torch.float64))


def test_errors():
    zero = DanaZero(torch.zeros(3), 2, lr=0.1, momentum=0.9)
    with pytest.raises(AggregationInputError) as e:
        zero.read(2)
    assert str(e.value) == "worker must be an integer in [0, 2), got 2"
    with pytest.raises(AggregationInputError) as e:
        zero.write(0, torch.zeros(4))
    assert str(e.value) == "grad must have shape (3,), got (4,)"
    with pytest.raises(AggregationInputError) as e:
        DanaSlimWorker(torch.zeros(3), momentum=1.0)
    assert str(e.value) == "momentum must be a number in [0, 1), got 1.0"
    ga = DanaZero(torch.zeros(3), 2, lr=0.1, momentum=0.9, gap_aware=GapAware(lr_max=0.1))
    with pytest.raises(AggregationInputError) as e:
        ga.write(1, torch.zeros(3))
    assert str(e.value) == "worker 1 wrote before it read: DANA-GA cannot know its gap"
