"""A validator's replay of a DiLoCo phase through the library (peer/phase_replay.py), without a swarm."""

import pytest
import torch
import torch.nn.functional as F

from phalanx.errors import ConfigError, PhalanxError
from phalanx.peer.outer_step import write_flat
from phalanx.peer.phase_replay import PhaseReplay
from phalanx.tasks import batch_generator

H = 6


def batch_fn(seed: int, peer_id: str, step: int):
    g = batch_generator(seed, peer_id, step)
    return torch.randn(8, 5, generator=g), torch.randint(3, (8,), generator=g)


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def take_phase(model, optimizer, scheduler, replay, peer_id: str, first: int) -> torch.Tensor:
    """What a verified peer's loop does for one phase (as phalanx.Optimizer.step() drives it); its Δ."""
    params = list(model.parameters())
    anchor = flat(params)
    for step in range(first, first + H):
        if step == first:
            replay.phase_starts()
        replay.record(step)
        loss_fn(model, batch_fn(7, peer_id, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return anchor - flat(params)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd-dampened": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=False),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_replay_of_a_phase_is_bit_identical_and_another_peers_is_not(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = OPTIMIZERS[name](model.parameters())
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))  # changes lr every step
    replay = PhaseReplay(model, optimizer, batch_fn, loss_fn, seed=7)
    params = list(model.parameters())
    take_phase(model, optimizer, warmup, replay, "me", first=0)  # the first phase warms the optimizer state up
    theta = flat(params)  # θ_1: in a swarm, the outer step's; here, where the second phase starts
    delta = take_phase(model, optimizer, warmup, replay, "me", first=H)
    x = flat(params)
    assert torch.equal(replay.delta("me", H, H, theta, params), delta)  # fresh state, recorded lrs: exact
    assert torch.equal(flat(params), x)  # the replay ran on a copy
    other = replay.delta("someone-else", H, H, theta, params)
    assert not torch.allclose(other, delta)
    # without the fresh start the state of the first phase carries over, and the replay no longer matches
    write_flat(params, theta)
    for step in range(H, 2 * H):
        loss_fn(model, batch_fn(7, "me", step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(theta - flat(params), delta)


def test_a_phase_this_peer_did_not_take_cannot_be_replayed():
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replay = PhaseReplay(model, optimizer, batch_fn, loss_fn, seed=7)
    replay.phase_starts()
    replay.record(0)
    with pytest.raises(PhalanxError, match="did not take steps 1"):
        replay.delta("me", 0, 2, flat(model.parameters()), list(model.parameters()))


class Opaque(torch.optim.SGD):
    """An optimizer whose constructor cannot take param groups and its own defaults."""

    def __init__(self, model_params, secret):
        super().__init__(model_params, lr=0.1)
        del secret


def test_an_optimizer_that_cannot_be_rebuilt_is_refused_with_one_line():
    model = torch.nn.Linear(5, 3)
    with pytest.raises(ConfigError, match=r"rebuild your optimizer as Opaque\(param_groups\)"):
        PhaseReplay(model, Opaque(model.parameters(), secret=1), batch_fn, loss_fn, seed=7)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the sitter's own optimizer never steps
def test_a_validator_sitting_a_phase_out_replays_the_targets_step_by_step_bit_identically():
    """The sitter records each step's hyperparameters as its loop goes and takes the target's step on its
    replica instead of its own: at the phase's end the target's Δ is ready, and its own θ has not moved."""
    torch.manual_seed(0)
    target_model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    sitter_model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    sitter_model.load_state_dict(target_model.state_dict())
    runs = {}
    for name, model in (("target", target_model), ("sitter", sitter_model)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
        runs[name] = (model, optimizer, scheduler, PhaseReplay(model, optimizer, batch_fn, loss_fn, seed=7))
    model, optimizer, scheduler, replay = runs["target"]
    delta = take_phase(model, optimizer, scheduler, replay, "target", first=0)

    model, optimizer, scheduler, replay = runs["sitter"]
    params = list(model.parameters())
    theta = flat(params)
    replay.begin("target", 0, theta, params)
    losses = []
    for step in range(H):
        if step == 0:
            replay.phase_starts()
        replay.record(step)
        losses.append(replay.step(step))
        scheduler.step()
    replay.finish()
    assert replay.ready is not None and replay.ready[:2] == ("target", 0)
    assert torch.equal(replay.ready[2], delta)
    assert torch.equal(flat(params), theta) and len(losses) == H and all(torch.isfinite(x) for x in losses)
