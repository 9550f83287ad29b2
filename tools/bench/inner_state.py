"""`phalanx bench inner-state`: what verified diloco's fresh inner optimizer state costs in quality.

A verified phase starts from a fresh inner state (a validator can rebuild nothing else from θ_t and
the public batches), with the learning rate ramping up again over `phase_warmup` steps; an unverified
phase keeps each peer's state, as DiLoCo does; and a member drawn to validate sits a phase out, so its
round counts one contribution fewer. Whether that costs outer steps is a question of optimisation, not
of the network, so this simulates the swarm's outer steps in one process: every peer's H inner steps
on its own batches (the ones `phalanx join` draws), the mean of their Δ, the Nesterov outer step, with
the same seeds for every variant, and prints the metric after each outer step (mean and spread over
the seeds) and the outer steps each variant takes to the target.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.tools.bench import bench_console


@dataclass(frozen=True)
class Variant:
    label: str
    fresh: bool  # every phase from a fresh inner state (verified) or each peer's kept state (unverified)
    warmup: int  # the phase's learning-rate ramp (verified runs: --phase-warmup)
    sitters: int  # members drawn each round (after the first) to sit the next phase out


def variants(phase_warmup: int, validators: int) -> list[Variant]:
    """Unverified, then what a verified run changes one thing at a time, then all of it."""
    return [
        Variant("kept (unverified)", False, 0, 0),
        Variant("fresh, no ramp", True, 0, 0),
        Variant(f"fresh, ramp {phase_warmup}", True, phase_warmup, 0),
        Variant(f"fresh, ramp {phase_warmup}, {validators} sitting (verified)", True, phase_warmup, validators),
    ]


def simulate(
    task: str, options: str, variant: Variant, *, peers: int, inner_steps: int, rounds: int, seed: int, metric: str,
    outer_lr: float = 0.7, outer_momentum: float = 0.9, lr: float | None = None,
) -> list[float]:
    """The metric after each of `rounds` outer steps of `peers` peers, for `variant`."""
    from phalanx.peer.config import PeerConfig
    from phalanx.peer.model import Model, zero_optimizer_state
    from phalanx.peer.outer_step import nesterov_outer_step, phase_lr_scale
    from phalanx.peer.plan import make_plan
    from phalanx.peer.trainer import task_options
    from phalanx.protocol.btard.validator import drawn_to_sit_out
    from phalanx.tasks import compute_gradient, resolve_task

    plan = make_plan(
        PeerConfig(task=task, task_options=options, mode="diloco", inner_steps=inner_steps, device="cpu",
                   outer_lr=outer_lr, outer_momentum=outer_momentum, lr=lr)
    )  # fmt: skip
    config = plan.training
    resolved = resolve_task(task, **task_options(config))
    names = [f"peer-{i}" for i in range(peers)]
    models = [Model(resolved, config) for _ in names]  # the same θ_0 (config.seed), each its own inner state
    theta = models[0].flat_params()
    momentum = torch.zeros_like(theta)
    sitting: set[str] = set()
    history = []
    for t in range(rounds):
        deltas = []
        for name, model in zip(names, models, strict=True):
            model.load_flat_params(theta)
            if variant.fresh:
                zero_optimizer_state(model.optimizer)
            if name in sitting:
                continue
            for k in range(inner_steps):
                position = t * inner_steps + k
                _, grad = compute_gradient(resolved, model.module, seed, name, position, resolved.batch_size)
                model.apply(grad, position, lr_scale=phase_lr_scale(k, variant.warmup))
            deltas.append(theta - model.flat_params())
        nesterov_outer_step(
            theta, momentum, torch.stack(deltas).mean(0), plan.outer.outer_lr, plan.outer.outer_momentum
        )
        round_seed = hashlib.sha256(f"{seed}:{t}".encode()).digest()  # stands in for the round's public seed
        sitting = drawn_to_sit_out(round_seed, names, variant.sitters)
        models[0].load_flat_params(theta)
        history.append(resolved.evaluate(models[0].module)[metric])
    return history


def steps_to(history: list[float], metric: str, target: float) -> int | None:
    """The first outer step (counted from 1) whose metric reaches the target."""
    from phalanx.tools.bench.swarm import _met

    return next((t + 1 for t, v in enumerate(history) if _met({metric: v}, metric, target)), None)


def run_inner_state_bench(
    goal: Any,
    *,
    peers: int,
    inner_steps: int,
    rounds: int,
    seeds: int,
    phase_warmup: int,
    validators: int,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    lr: float | None = None,
    unverified_only: bool = False,
    console=None,
) -> dict[str, list[list[float]]]:
    from rich.table import Table

    console = console or bench_console()
    torch.set_num_threads(1)
    results: dict[str, list[list[float]]] = {}
    inner_lr = "the task's inner learning rate" if lr is None else f"inner learning rate {lr:g}"
    for variant in variants(phase_warmup, validators)[: 1 if unverified_only else None]:
        console.print(
            f"simulating {variant.label}: {peers} peers, H = {inner_steps}, {inner_lr}, outer lr {outer_lr:g},"
            f" outer momentum {outer_momentum:g}, {rounds} outer steps, {seeds} seed(s)…"
        )
        results[variant.label] = [
            simulate(
                goal.task,
                goal.task_options,
                variant,
                peers=peers,
                inner_steps=inner_steps,
                rounds=rounds,
                seed=seed,
                metric=goal.metric,
                outer_lr=outer_lr,
                outer_momentum=outer_momentum,
                lr=lr,
            )  # fmt: skip
            for seed in range(seeds)
        ]
    table = Table(
        title=f"{goal.metric} after each outer step, mean ± spread over {seeds} seed(s); outer steps to {goal}"
    )
    table.add_column("variant")
    for t in range(rounds):
        table.add_column(str(t + 1), justify="right")
    table.add_column("steps to target", justify="right")
    for label, runs in results.items():
        cells = []
        for t in range(rounds):
            values = [h[t] for h in runs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.3f} ±{spread:.3f}")
        reached = [s for s in (steps_to(h, goal.metric, goal.target) for h in runs) if s is not None]
        if len(reached) < len(runs):
            to = f"not reached in {len(runs) - len(reached)} of {len(runs)}"
        else:
            to = f"{statistics.median(reached):g} ({min(reached)}–{max(reached)})"
        table.add_row(label, *cells, to)
    console.print(table)
    return results
