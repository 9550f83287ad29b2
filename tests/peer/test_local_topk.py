"""lasgd/gossip with --compression topk:<fraction>: a peer sends the largest entries of its progress plus
its residual and keeps the rest (error feedback), gives them back when the exchange fails, and drops
them with progress the swarm left behind."""

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from phalanx.peer.config import PeerConfig
from phalanx.peer.local_exchange import LocalExchange
from phalanx.peer.model import Trainable
from phalanx.peer.plan import make_plan

FRACTION = 0.1


def _exchange(**settings) -> tuple[LocalExchange, Trainable]:
    """A lasgd peer's exchange on a small linear model, with a stand-in engine (no swarm: the math only)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 5)
    trainable = Trainable(list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1), model)
    plan = make_plan(PeerConfig(mode="lasgd", compression=f"topk:{FRACTION}", device="cpu", **settings))
    engine = SimpleNamespace(state=SimpleNamespace(keep_serving=lambda key: None))
    return LocalExchange(engine, trainable, plan.exchange, lr=0.1, timeout_s=5.0, in_thread=None), trainable


def _train(trainable: Trainable, scale: float = 0.01) -> None:
    trainable.load_flat_params(trainable.flat_params() + scale * torch.randn(trainable.numel))


def _contribute(local: LocalExchange, members: int = 1, versions=None) -> torch.Tensor:
    local.snapshot()
    group = SimpleNamespace(members=[f"peer{i}" for i in range(members)], versions=versions)
    update, weight = asyncio.run(local.contribution(group))
    return update


def _averaged(vector: torch.Tensor, versions=None):
    return SimpleNamespace(result=SimpleNamespace(vector=vector), group=SimpleNamespace(versions=versions))


def test_what_is_sent_plus_what_is_kept_is_what_was_contributed_exactly():
    local, trainable = _exchange()
    k = math.ceil(FRACTION * trainable.numel)
    residual = torch.zeros(trainable.numel)
    for _ in range(4):
        _train(trainable)
        progress = trainable.flat_params() - local.state.base
        sent = _contribute(local)
        assert int((sent != 0).sum()) <= k
        assert torch.equal(sent + local.feedback.residual, residual + progress)  # entry by entry, whole
        assert float(sent.abs().max()) == float((residual + progress).abs().max())
        residual = local.feedback.residual.clone()
        local.merge(_averaged(sent))  # alone in its group: the average is what it sent
        assert torch.equal(local.state.base, trainable.flat_params())  # x = b' (no steps since the snapshot)


def test_a_failed_exchange_gives_back_what_it_took_and_the_next_sends_it_again():
    local, trainable = _exchange()
    _train(trainable)
    sent = _contribute(local)
    assert local.feedback.residual.any()
    local.failed()  # nothing was delivered: the next exchange's progress covers the same steps
    assert not local.feedback.residual.any()
    assert torch.equal(_contribute(local), sent)


def test_progress_given_up_for_the_swarms_model_takes_the_residual_with_it():
    local, trainable = _exchange(max_gap=1)
    _train(trainable)
    _contribute(local)
    local.merge(_averaged(torch.zeros(trainable.numel)))
    assert local.feedback.residual.any()
    # three versions behind the group (max_gap 1): it contributes nothing and takes the swarm's base
    swarm_base = local.state.base + 0.5

    async def fetch(index):
        return swarm_base

    local.fetch_base = lambda donor, version: fetch(0)
    before = local.feedback.residual.clone()
    _train(trainable)
    sent = _contribute(local, members=2, versions=[local.version, local.version + 3])
    assert not sent.any() and torch.equal(local.feedback.residual, before)  # nothing taken from it
    local.merge(_averaged(torch.zeros(trainable.numel), versions=[local.version, local.version + 3]))
    assert not local.feedback.residual.any()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"mode": "sync"}, "needs --mode diloco, lasgd or gossip"),
        ({"mode": "lasgd", "average_optimizer_state": True}, "with --average-optimizer-state"),
    ],
)
def test_topk_is_refused_where_it_has_no_residual_to_keep(settings, message):
    with pytest.raises(ValueError, match=message):
        PeerConfig(compression="topk:0.1", **settings)


def test_the_fraction_is_part_of_a_lasgd_runs_configuration():
    hashes = {make_plan(PeerConfig(mode="lasgd", compression=c)).run_hash for c in ("topk:0.1", "topk:0.2", "int8")}
    assert len(hashes) == 3
