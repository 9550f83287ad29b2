"""The plan: settings parsed once into sections and rules; the run hash peers compare."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from phalanx.errors import ConfigError
from phalanx.peer.config import NetworkSettings, PeerConfig, load_settings
from phalanx.peer.plan import PARSED, ExchangeConfig, OuterConfig, TrainingConfig, make_plan


def _plan(overrides):
    return make_plan(load_settings(PeerConfig, overrides))


DERIVED = {"topk_fraction"}  # section fields parsed from a setting of another name (--compression topk:F)


def test_every_setting_reaches_the_plan():
    sections = {f.name for cls in (TrainingConfig, ExchangeConfig, OuterConfig) for f in dataclasses.fields(cls)}
    sections -= DERIVED
    assert not sections & PARSED and not sections & set(NetworkSettings.model_fields)
    assert sections | PARSED | set(NetworkSettings.model_fields) == set(PeerConfig.model_fields)


def test_topk_is_the_sparse_codec_on_the_wire_and_a_fraction_in_the_outer_section():
    plan = _plan({"mode": "diloco", "compression": "topk:0.05"})
    assert plan.outer.topk_fraction == 0.05 and plan.round.compression.value == "sparse"
    assert plan.run_hash != _plan({"mode": "diloco", "compression": "topk:0.1"}).run_hash
    assert _plan({"mode": "diloco"}).outer.topk_fraction is None


def test_rules_are_parsed_into_the_plan():
    plan = _plan({"mode": "lasgd", "sync_policy": "k:2", "slowdown": "const:0.5", "attack": "sign_flip", "lr": 0.2})
    assert plan.sync_policy.spec == "k:2" and plan.slowdown.draw(None) == 0.5
    assert plan.attack.name == "sign_flip" and plan.attack.gradient.name == "sign_flip"
    assert plan.training.lr == 0.2 and plan.exchange.sync_every == 10
    assert plan.round.matchmaking.min_group_size == 2 and not plan.round.matchmaking.lockstep
    assert plan.run_key == f"phalanx.phalanx.{plan.run_hash.hex()[:16]}"


def test_aggregator_parameters_in_the_name_or_in_their_own_flag_are_one_setting():
    spec = _plan({"aggregator": "bucketing:s=2,inner=mean"})
    assert spec.round.aggregator == "bucketing" and spec.round.aggregator_params == (("inner", "mean"), ("s", 2.0))
    assert spec.run_hash == _plan({"aggregator": "bucketing", "aggregator_params": "s=2,inner=mean"}).run_hash
    assert spec.run_hash == _plan({"aggregator": "bucketing:s=2.0, inner=mean"}).run_hash
    tau = _plan({"aggregator": "centered_clip", "tau": 1.0}).run_hash
    assert _plan({"aggregator": "centered_clip:tau=1"}).run_hash == tau


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"aggregator": "bucketing:s=2", "aggregator_params": "inner=mean"},
            "--aggregator bucketing:s=2 and --aggregator-params inner=mean both give parameters: keep one of them",
        ),
        ({"aggregator": "centered_clip:tau=big"}, "--aggregator centered_clip:tau=big: parameters are name=number pairs like tau=1, not 'tau=big'"),
        ({"aggregator": "bucketing:s=2,inner"}, "parameters go as key=value after ':'"),
        ({"aggregator": "clipped_gossip:tau=1"}, "use it with --mode gossip (or lasgd)"),
        ({"attack": "sign_flip:scale=2"}, "--attack sign_flip:scale=2: sign_flip takes no parameters; give its name"),
        ({"attack": "nope"}, "--attack: unknown attack 'nope'; valid: sign_flip"),
    ],
)
def test_plan_errors_name_the_flag(overrides, message):
    with pytest.raises(ConfigError) as info:
        _plan(overrides)
    assert message in str(info.value)


CODE = """
import json, sys
from phalanx.peer.config import PeerConfig, load_settings
from phalanx.peer.plan import make_plan
print(make_plan(load_settings(PeerConfig, json.loads(sys.argv[1]))).run_hash.hex())
"""


SAMPLES = [
    {},
    {"aggregator": "bucketing:s=2,inner=median", "mode": "gossip"},
    {"aggregator": "centered_clip", "tau": 1.0, "verify": True, "sync_policy": "adasync:2:10"},
]


@pytest.mark.parametrize("overrides", SAMPLES)
def test_run_hash_is_the_same_in_every_process(overrides):
    """Peers compare it: nothing process-dependent (hash seeds, object addresses, ports) may reach it."""
    hashes = set()
    for seed, port in (("1", "0"), ("2", "4000")):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PHALANX_PORT": port}
        done = subprocess.run([sys.executable, "-c", CODE, json.dumps(overrides)], capture_output=True, text=True,
                              env=env, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        hashes.add(done.stdout.strip())
    assert hashes == {_plan(overrides).run_hash.hex()}
