"""Decentralized methods: N local models, no server. The evaluated model is their plain average.

LASGD (Avidor & Tal Israel): every worker keeps taking local steps and never waits. Once
it has taken H steps since its last snapshot and its previous all-reduce has completed,
it snapshots its model into the next all-reduce round; a round completes when all N
snapshots are in (the aggregator combines them) and each worker merges at its next step
boundary: x ← avg(snapshots) + (x_now − x_snapshot), keeping the progress made meanwhile.

Gossip (AD-PSGD): when worker i finishes a minibatch (computed at the x_i it read), it
averages with one peer j drawn uniformly, x_i, x_j ← (x_i + x_j)/2 (ClippedGossip with
radius τ; τ = inf is plain averaging), then applies its gradient to the averaged x_i.

Local steps use torch's SGD with heavy-ball momentum, one optimizer per worker.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from phalanx.aggregation.gossip import clipped_gossip_update
from phalanx.aggregation.registry import BoundAggregator
from phalanx.sim.config import Budget
from phalanx.sim.record import Progress, Recorder
from phalanx.sim.rules import finite
from phalanx.sim.workers import Job, Workers

_GOSSIP_STREAM = 0x6055


class _LocalModels:
    """x_k and its optimizer for every worker; the heap of minibatches in flight."""

    def __init__(self, theta0: Tensor, workers: Workers, *, lr: float, momentum: float) -> None:
        self.workers = workers
        self.x = [theta0.detach().clone() for _ in range(workers.n)]
        self.opts = [torch.optim.SGD([x], lr=lr, momentum=momentum, foreach=False) for x in self.x]
        self.version = [0] * workers.n  # changes to x_k (steps and averages)
        self.heap: list[tuple[float, int, Job]] = []

    def start(self, worker: int, now_s: float) -> None:
        job = self.workers.start(worker, self.x[worker].clone(), self.version[worker], now_s)
        heapq.heappush(self.heap, (job.finish_s, worker, job))

    def step(self, worker: int, grad: Tensor) -> None:
        self.x[worker].grad = grad
        self.opts[worker].step()
        self.version[worker] += 1

    def average(self) -> Tensor:
        return torch.stack(self.x).mean(dim=0)  # (N, d) → (d,)


def _loop(
    models: _LocalModels, budget: Budget, recorder: Recorder, p: Progress, on_finish: Callable[[int, Job, Tensor], None]
) -> Progress:
    """Process minibatch completions in time order; ``on_finish`` applies one (worker, job, gradient)."""
    recorder.record(p, models.average())
    for w in range(models.workers.n):
        models.start(w, 0.0)
    while models.heap and not recorder.done(p):
        if budget.kind == "time" and models.heap[0][0] > budget.amount:
            break
        p.time_s, w, job = heapq.heappop(models.heap)
        grad = models.workers.gradient(job)
        p.observe_loss(job.loss)
        on_finish(w, job, grad)
        p.updates += 1
        p.gradients += 1
        if not finite(models.x[w]):
            p.diverged = True
        models.start(w, p.time_s)
        recorder.maybe(p, models.average)
    if budget.kind == "time" and not p.diverged:
        p.time_s = budget.amount
    recorder.record(p, models.average())
    return p


def run_lasgd(
    theta0: Tensor,
    workers: Workers,
    *,
    lr: float,
    momentum: float,
    local_steps: int,
    aggregator: BoundAggregator,
    budget: Budget,
    recorder: Recorder,
) -> Progress:
    """LASGD; the all-reduce itself takes no virtual time (a compute-only model, as in Dutta et al.)."""
    models = _LocalModels(theta0, workers, lr=lr, momentum=momentum)
    n, p = workers.n, Progress()
    rounds: list[dict[int, Tensor]] = []  # round r: worker → its snapshot
    averages: dict[int, Tensor] = {}  # completed rounds not yet merged by everyone
    joined = [0] * n  # rounds worker k has snapshotted into
    merged = [0] * n  # rounds worker k has merged
    steps = [0] * n  # local steps of worker k
    snap_step = [0] * n  # steps[k] at worker k's latest snapshot

    def on_finish(w: int, job: Job, grad: Tensor) -> None:
        models.step(w, grad)
        steps[w] += 1
        if joined[w] == merged[w] and steps[w] - snap_step[w] >= local_steps:  # join the next all-reduce
            if joined[w] == len(rounds):
                rounds.append({})
            rounds[joined[w]][w] = models.x[w].clone()
            joined[w] += 1
            snap_step[w] = steps[w]
        r = merged[w]
        if joined[w] > r and len(rounds[r]) == n:  # our all-reduce completed: merge at this step boundary
            if r not in averages:
                averages[r] = aggregator(torch.stack([rounds[r][k] for k in range(n)])).value  # (N, d) → (d,)
            x = models.x[w]
            x.copy_(averages[r] + (x - rounds[r][w]))
            models.version[w] += 1
            p.staleness.append(steps[w] - snap_step[w])
            merged[w] += 1
            if min(merged) > r:  # everyone merged: free the round
                del averages[r]
                rounds[r] = {}

    return _loop(models, budget, recorder, p, on_finish)


def run_gossip(
    theta0: Tensor,
    workers: Workers,
    *,
    lr: float,
    momentum: float,
    tau: float,
    seed: int,
    budget: Budget,
    recorder: Recorder,
) -> Progress:
    models = _LocalModels(theta0, workers, lr=lr, momentum=momentum)
    n, p = workers.n, Progress()
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _GOSSIP_STREAM])))
    half = torch.tensor([0.5], dtype=theta0.dtype)

    def on_finish(w: int, job: Job, grad: Tensor) -> None:
        if n > 1:
            j = int(rng.integers(n - 1))
            j += j >= w  # uniform over the others
            xw, xj = models.x[w], models.x[j]
            new_w = clipped_gossip_update(xw, xj.unsqueeze(0), half, tau).value  # x_w + c·(x_j − x_w)
            # The pair is symmetric (same distance, same clip c): x_j + c·(x_w − x_j) = x_w + x_j − new_w.
            xj.add_(xw).sub_(new_w)
            xw.copy_(new_w)
            models.version[j] += 1
            models.version[w] += 1
        p.staleness.append(models.version[w] - job.version)
        models.step(w, grad)

    return _loop(models, budget, recorder, p, on_finish)
