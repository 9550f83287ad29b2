"""sim/decentral.py: LASGD merges and AD-PSGD gossip against hand-written references."""

from __future__ import annotations

import torch

from phalanx.sim.config import Budget, SimConfig
from phalanx.sim.runner import load_task, run_sim
from phalanx.tasks import compute_gradient, flat_params, set_flat_params


def grad_at(theta: torch.Tensor, worker: int, step: int) -> torch.Tensor:
    task = load_task("digits-mlp")
    model = task.build_model(0)
    set_flat_params(model, theta)
    return compute_gradient(task, model, 0, f"sim-{worker}", step, task.batch_size)[1]


def test_lasgd_merge_staleness_under_const_delays():
    # All N snapshot at the same virtual time; the last one completes the all-reduce and merges at
    # once (0 steps late), the others at their next step (1 step late).
    n, h = 4, 3
    result = run_sim(
        SimConfig(
            method="lasgd", workers=n, delay="const", local_steps=h, budget=Budget(kind="gradients", amount=8 * n)
        )
    )
    assert result.staleness[:n] == [0] + [1] * (n - 1)


def test_lasgd_without_all_reduce_is_independent_local_sgd():
    steps = 6
    result = run_sim(
        SimConfig(
            method="lasgd",
            workers=2,
            delay="const",
            local_steps=10**6,
            budget=Budget(kind="gradients", amount=2 * steps),
        )
    )
    task = load_task("digits-mlp")
    finals = []
    for w in range(2):
        model = task.build_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=task.momentum)
        for s in range(steps):
            compute_gradient(task, model, 0, f"sim-{w}", s, task.batch_size)
            opt.step()
        finals.append(flat_params(model))
    torch.testing.assert_close(result.params, (finals[0] + finals[1]) / 2, rtol=1e-4, atol=2e-6)


def test_gossip_pairs_average_then_step():
    # N = 2, const delays, no momentum: at every time unit worker 0 then worker 1 finish; each
    # averages with the other (the only peer), then applies the gradient of the model it read.
    rounds, lr = 4, load_task("digits-mlp").lr
    result = run_sim(
        SimConfig(
            method="gossip", workers=2, delay="const", momentum=0.0, budget=Budget(kind="gradients", amount=2 * rounds)
        )
    )
    theta0 = load_task("digits-mlp").build_model(0)
    x = [flat_params(theta0), flat_params(theta0)]
    read = [x[0].clone(), x[1].clone()]
    for r in range(rounds):
        for w in (0, 1):
            g = grad_at(read[w], w, r)
            avg = (x[0] + x[1]) / 2
            x = [avg.clone(), avg.clone()]
            x[w] = x[w] - lr * g
            read[w] = x[w].clone()
    torch.testing.assert_close(result.params, (x[0] + x[1]) / 2, rtol=1e-4, atol=2e-6)
    assert result.staleness == [1, 2] + [2, 2] * (rounds - 1)  # own average + the other's since the read
