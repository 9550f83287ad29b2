"""The global step's accumulation and weights, against a stand-in for the node (no network)."""

import asyncio
from types import SimpleNamespace

import torch

from phalanx.peer.global_step import GlobalStep
from phalanx.peer.model import Trainable


class _Engine:
    step = 0

    def __init__(self) -> None:
        self.rounds = []

    async def run_round(self, request):
        checks = request.verification  # only validators' recomputations are waited for
        assert checks.recompute is not None or checks.recompute_s == 0.0
        self.rounds.append((request.vector.clone(), request.weight))
        raise asyncio.CancelledError  # the test looks at what was sent only


def _global_step(trainers: int, target, batch: int = 8) -> tuple[GlobalStep, _Engine]:
    engine = _Engine()
    node = SimpleNamespace(engine=engine, membership=SimpleNamespace(peers=lambda: dict.fromkeys(range(trainers))))
    param = torch.nn.Parameter(torch.zeros(4))
    trainable = Trainable([param], torch.optim.SGD([param], lr=0.1))
    steps = GlobalStep(node, trainable, batch_size_per_step=batch, target_batch_size=target, wait_for_peers=1, in_thread=None)
    return steps, engine


def _send(steps: GlobalStep) -> None:
    try:
        asyncio.run(steps.round())
    except asyncio.CancelledError:
        pass


def test_a_share_of_the_target_is_accumulated_and_sent_as_its_mean_with_weight_by_samples():
    steps, engine = _global_step(trainers=2, target=48)
    assert steps.share == 24  # 48 split between 2 trainers: 3 steps of 8
    grads = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 0.0, 1.0, 0.0]), torch.tensor([2.0, 1.0, 2.0, 2.0])]
    for i, g in enumerate(grads):
        assert not steps.ready
        steps.add(g)
        assert steps.samples == 8 * (i + 1)
    assert steps.ready
    _send(steps)
    vector, weight = engine.rounds[-1]
    assert torch.equal(vector, torch.stack(grads).mean(0))
    assert weight == 24 / (48 + 8) and weight <= 1.0  # reducers clamp weights at 1


def test_unequal_shares_average_as_one_batch_of_all_their_samples():
    a, ea = _global_step(trainers=1, target=48)  # sees only itself: 6 steps
    b, eb = _global_step(trainers=3, target=48)  # sees three: 2 steps
    ga, gb = torch.tensor([6.0, 0, 0, 0]), torch.tensor([0, 3.0, 0, 0])
    for _ in range(6):
        a.add(ga)
    for _ in range(2):
        b.add(gb)
    _send(a)
    _send(b)
    (va, wa), (vb, wb) = ea.rounds[-1], eb.rounds[-1]
    weighted = (wa * va + wb * vb) / (wa + wb)  # what a reducer's weighted mean computes
    union = (6 * ga + 2 * gb) / 8  # the mean gradient over all 64 samples
    assert torch.allclose(weighted, union)


def test_without_a_target_every_step_is_a_round_of_weight_one():
    steps, engine = _global_step(trainers=4, target=None)
    steps.add(torch.ones(4))
    assert steps.ready
    _send(steps)
    assert engine.rounds[-1][1] == 1.0
