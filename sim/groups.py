"""Grouped rounds: N peers, each with its own model, averaged in random groups of at most G.

Every round each peer computes one minibatch gradient at its own parameters and takes a
local Nesterov step; then the peers are split into groups of at most G, drawn afresh from
the round's seed, and every member of a group takes the group's aggregate of its members'
models. Byzantine members send forged rows, built from the honest rows of the same group
(omniscient and colluding, as in the parameter-server simulation). Where they are a
majority of a group, the aggregate is theirs to choose whatever the attack: they all send
−1000 × the honest members' mean row, and what that does to the group's honest members
depends on the aggregator alone.

Rows are models in gradient units, r_i = (θ_i − η·s_i)/η with s_i the Nesterov step, so a
robust aggregator's radius means what it means for gradients: with one group of all N
(G = N) every peer holds the same θ, the rows differ by their steps only, and a round is
exactly synchronous SGD on the aggregator of the steps. The evaluated model is the mean of
the honest peers' models; the spread is how far the farthest honest peer is from it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from phalanx.aggregation.attacks import make_attack
from phalanx.aggregation.registry import BoundAggregator
from phalanx.protocol.groups import draw_groups
from phalanx.sim.byzantine import Adversary
from phalanx.sim.config import Budget
from phalanx.sim.gradients import GradientOracle
from phalanx.sim.record import Progress, Recorder
from phalanx.sim.rules import finite

_CAPTURE = make_attack("sign_flip", scale=-1000.0)


def spread(models: Tensor) -> float:
    """max_i ‖θ_i − θ̄‖ / ‖θ̄‖ over the rows of models (m, d)."""
    mean = models.mean(dim=0)
    return float((models - mean).norm(dim=1).max() / mean.norm().clamp_min(1e-12))


def run_grouped(
    oracle: GradientOracle,
    n: int,
    *,
    group_size: int,
    lr: float,
    momentum: float,
    aggregator: BoundAggregator,
    adversary: Adversary,
    seed: int,
    budget: Budget,
    recorder: Recorder,
) -> Progress:
    """Rounds until the budget is spent; one round is one update, N gradients and one unit of virtual time."""
    honest = [w for w in range(n) if not adversary.is_byzantine(w)]
    models = oracle.theta0.repeat(n, 1)  # (n, d)
    buffers = torch.zeros_like(models)  # (n, d) Nesterov momentum per peer
    p = Progress(spread=0.0, captured_groups=0)

    def honest_mean() -> Tensor:
        return models[honest].mean(dim=0)

    recorder.record(p, honest_mean())
    while not recorder.done(p):
        if budget.kind == "time" and p.time_s + 1 > budget.amount:
            break
        r = p.updates
        flips = [adversary.flips_labels(w, r) for w in range(n)]
        grads, losses = oracle.compute(models, list(range(n)), [r] * n, flips)  # (n, d)
        for w in honest:
            p.observe_loss(losses[w])
        buffers.mul_(momentum).add_(grads)
        steps = grads + momentum * buffers if momentum else grads
        rows = models / lr - steps  # (n, d)
        for group in draw_groups(n, group_size, seed, r):
            good = [w for w in group if not adversary.is_byzantine(w)]
            captured = 2 * len(good) < len(group) and r >= adversary.start
            p.captured_groups += captured  # type: ignore[operator]
            if not captured or not good:  # (a group of attackers alone harms no honest model)
                sent = torch.stack(adversary.forge(group, [rows[w] for w in group], r))
            else:
                bad = _CAPTURE(rows[good], len(group) - len(good), generator=adversary.generator)
                sent = torch.cat([rows[good], bad])
            models[group] = lr * aggregator(sent).value
        p.updates += 1
        p.gradients += n
        p.time_s += 1.0
        p.spread = spread(models[honest])
        if not finite(models):
            p.diverged = True
        recorder.maybe(p, honest_mean)
    recorder.record(p, honest_mean())
    p.worst_accuracy = min(recorder.oracle.evaluate(models[w])["accuracy"] for w in honest)
    return p
