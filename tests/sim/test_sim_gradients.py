"""sim/gradients.py: the batched engines agree with the task's own compute_gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.sim.gradients import GradientOracle, peer_id
from phalanx.sim.runner import load_task
from phalanx.tasks import Task, compute_gradient, set_flat_params


def rows(oracle: GradientOracle, m: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return oracle.theta0 + 0.05 * torch.randn(m, oracle.dim, generator=g)  # (m, d): different parameters per row


def tiny_task() -> Task:
    """A model the mlp engine does not take (LayerNorm), on random data."""
    g = torch.Generator().manual_seed(1)
    return Task(
        name="tiny",
        model_fn=lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)),
        train_inputs=torch.randn(50, 6, generator=g),
        train_targets=torch.randint(3, (50,), generator=g),
        test_inputs=torch.randn(10, 6, generator=g),
        test_targets=torch.randint(3, (10,), generator=g),
        batch_size=8,
    )


def test_auto_picks_mlp_for_digits_and_vmap_otherwise():
    assert GradientOracle(load_task("digits-mlp"), seed=0, batch_size=32).engine == "mlp"
    assert GradientOracle(tiny_task(), seed=0, batch_size=8).engine == "vmap"


@pytest.mark.parametrize("task_name", ["digits", "tiny"])
def test_engines_agree_with_compute_gradient(task_name):
    task = load_task("digits-mlp") if task_name == "digits" else tiny_task()
    engines = ["mlp", "vmap", "loop"] if task_name == "digits" else ["vmap", "loop"]
    workers, steps, flip = [0, 5, 2], [0, 3, 9], [False, False, True]
    results = {}
    for engine in engines:
        oracle = GradientOracle(task, seed=7, batch_size=task.batch_size, engine=engine)
        results[engine] = oracle.compute(rows(oracle), workers, steps, flip)
    grads, losses = results["loop"]
    for engine in engines:
        torch.testing.assert_close(results[engine][0], grads, rtol=1e-4, atol=1e-6)
        assert results[engine][1] == pytest.approx(losses, rel=1e-5)
    # the honest rows are exactly what a live peer computes
    oracle = GradientOracle(task, seed=7, batch_size=task.batch_size, engine="loop")
    model = task.build_model(7)
    for i in range(2):
        set_flat_params(model, rows(oracle)[i])
        loss, g = compute_gradient(task, model, 7, peer_id(workers[i]), steps[i], task.batch_size)
        torch.testing.assert_close(grads[i], g)
        assert losses[i] == pytest.approx(loss)


def test_label_flip_uses_the_same_batch_with_flipped_targets():
    task = load_task("digits-mlp")
    oracle = GradientOracle(task, seed=0, batch_size=32)
    theta = oracle.theta0.unsqueeze(0)
    flipped, _ = oracle.compute(theta, [1], [4], [True])
    model = task.build_model(0)
    x, y = task.batch(0, "sim-1", 4, 32)
    task.loss(model, x, 9 - y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(flipped[0], expected, rtol=1e-4, atol=1e-6)


def test_weight_decay_is_part_of_the_gradient():
    task = tiny_task()
    task.weight_decay = 0.5
    plain = GradientOracle(tiny_task(), seed=0, batch_size=8)
    decayed = GradientOracle(task, seed=0, batch_size=8)
    p = rows(plain, 2)
    torch.testing.assert_close(decayed.compute(p, [0, 1], [0, 0], [False, False])[0],
                               plain.compute(p, [0, 1], [0, 0], [False, False])[0] + 0.5 * p)  # fmt: skip


def test_engine_errors():
    with pytest.raises(ConfigError, match="gradient engine 'jit' is unknown; use one of auto, mlp, vmap, loop"):
        GradientOracle(tiny_task(), seed=0, batch_size=8, engine="jit")
    with pytest.raises(ConfigError, match="gradient engine 'mlp' needs an nn.Sequential of Linear and activations"):
        GradientOracle(tiny_task(), seed=0, batch_size=8, engine="mlp")
