"""sim/byzantine.py: who attacks, what replaces their rows, and that robust aggregation matters."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import ConfigError
from phalanx.sim.byzantine import Adversary, attack_names
from phalanx.sim.config import Budget, ByzantineConfig, SimConfig
from phalanx.sim.runner import run_sim


def vectors(k: int, d: int = 5) -> list[torch.Tensor]:
    return [torch.full((d,), float(i + 1)) for i in range(k)]


def test_the_last_b_workers_attack():
    adv = Adversary(ByzantineConfig(count=2, attack="sign_flip"), 6, seed=0)
    assert [adv.is_byzantine(w) for w in range(6)] == [False] * 4 + [True] * 2


def test_gradient_attacks_see_the_honest_rows_of_their_group():
    adv = Adversary(ByzantineConfig(count=2, attack="sign_flip:scale=-1000"), 4, seed=0)
    sent = vectors(4)  # rows 1, 2 honest (workers 0, 1); rows 3, 4 Byzantine (workers 2, 3)
    out = adv.forge([0, 1, 2, 3], sent, update=0)
    assert out[:2] == sent[:2]
    for row in out[2:]:
        torch.testing.assert_close(row, torch.full((5,), -1500.0))  # −1000 × mean(1, 2)


def test_a_group_without_honest_rows_uses_the_attackers_own_computation():
    adv = Adversary(ByzantineConfig(count=1, attack="sign_flip"), 4, seed=0)
    out = adv.forge([3], [torch.ones(3)], update=0)
    torch.testing.assert_close(out[0], -torch.ones(3))


def test_attacks_wait_for_their_start():
    adv = Adversary(ByzantineConfig(count=1, attack="gaussian", start=10), 2, seed=0)
    sent = vectors(2)
    assert adv.forge([0, 1], sent, update=9) == sent
    assert not torch.equal(adv.forge([0, 1], sent, update=10)[1], sent[1])


def test_delayed_replays_its_own_rows_lag_contributions_back():
    adv = Adversary(ByzantineConfig(count=1, attack="delayed:lag=2"), 2, seed=0)
    replayed = [float(adv.forge([0, 1], [torch.zeros(1), torch.tensor([float(i)])], update=i)[1]) for i in range(6)]
    assert replayed == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]


def test_label_flip_is_a_property_of_the_minibatch():
    adv = Adversary(ByzantineConfig(count=1, attack="label_flip", start=3), 4, seed=0)
    assert not adv.flips_labels(3, update=2) and adv.flips_labels(3, update=3) and not adv.flips_labels(0, update=3)
    sent = vectors(4)
    assert adv.forge([0, 1, 2, 3], sent, update=5) == sent  # the gradient itself is already wrong


def test_every_attack_name_is_known():
    assert set(attack_names()) >= {"sign_flip", "random_direction", "ipm", "alie", "gaussian", "label_flip", "delayed"}


@pytest.mark.parametrize(
    ("attack", "message"),
    [
        ("bribe", "unknown attack 'bribe'; valid names: sign_flip"),
        ("label_flip:p=1", "attack 'label_flip': unknown parameter(s) p; valid parameters: none"),
        ("delayed:lag=0", "attack delayed: lag must be >= 1, got 0"),
        ("ipm:epsilon=1", "attack 'ipm': unknown parameter 'epsilon'; valid parameters: eps"),
    ],
)
def test_attack_errors(attack, message):
    with pytest.raises(ConfigError, match=message.replace("(s)", r"\(s\)")):
        Adversary(ByzantineConfig(count=1, attack=attack), 4, seed=0)


def test_centered_clip_survives_what_breaks_the_mean():
    def run(aggregator: str) -> float:
        config = SimConfig(
            method="ssgd", workers=8, momentum=0.9, budget=Budget(kind="updates", amount=60), aggregator=aggregator,
            byzantine=ByzantineConfig(count=1, attack="sign_flip:scale=-1000"), eval_points=2,
        )  # fmt: skip
        return run_sim(config).final_accuracy

    assert run("mean") < 0.3
    assert run("centered_clip:tau=1") > 0.8
