"""Simulated workers: each reads parameters, computes one minibatch gradient for a while, delivers it.

A `Job` is one minibatch in flight: the parameter snapshot it was read at, the worker's
step (which fixes its minibatch), and when it finishes on the virtual clock. Gradients are
computed lazily: when one is needed, every pending job is computed in one batched call.
That is exact (a gradient depends only on its snapshot and minibatch, not on when it is
computed) and lets a round of N workers cost one call instead of N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from phalanx.sim.clock import WorkerClock
from phalanx.sim.gradients import GradientOracle


@dataclass(eq=False)
class Job:
    """One minibatch in flight on worker ``worker``."""

    worker: int
    step: int
    """The worker's minibatch counter: its batch is Task.batch(seed, "sim-<worker>", step, B)."""
    start_s: float
    finish_s: float
    params: Tensor = field(repr=False)
    """(d,) the snapshot the gradient is computed at."""
    version: int
    """Model version (updates applied) when it was read; staleness = version at apply − this."""
    flip: bool = False
    """Label-flip Byzantine job: targets y → C − 1 − y."""
    grad: Tensor | None = field(default=None, repr=False)
    loss: float = float("nan")


class Workers:
    """N workers with their clocks and minibatch counters; computes pending gradients in batches."""

    def __init__(self, oracle: GradientOracle, clocks: list[WorkerClock]) -> None:
        self.oracle = oracle
        self.clocks = clocks
        self.steps = [0] * len(clocks)
        self._pending: dict[int, Job] = {}  # id(job) → job, in start order

    @property
    def n(self) -> int:
        return len(self.clocks)

    def start(self, worker: int, params: Tensor, version: int, now_s: float, *, flip: bool = False) -> Job:
        """Worker ``worker`` reads ``params`` at ``now_s`` and starts its next minibatch."""
        job = Job(worker, self.steps[worker], now_s, self.clocks[worker].finish(now_s), params, version, flip)
        self.steps[worker] += 1
        self._pending[id(job)] = job
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job whose gradient will never be used (K-sync's stragglers)."""
        self._pending.pop(id(job), None)

    def gradient(self, job: Job) -> Tensor:
        """The job's gradient; computes it, and every other pending job's, if not done yet."""
        if job.grad is None:
            jobs = list(self._pending.values())
            self._pending.clear()
            grads, losses = self.oracle.compute(
                torch.stack([j.params for j in jobs]),  # (m, d)
                [j.worker for j in jobs],
                [j.step for j in jobs],
                [j.flip for j in jobs],
            )
            for j, g, loss in zip(jobs, grads, losses, strict=True):
                j.grad, j.loss = g, loss
        if job.grad is None:
            raise RuntimeError(f"gradient() of a cancelled job: {job}")
        return job.grad
