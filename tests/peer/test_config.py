"""One settings model: flags beat PHALANX_* env vars beat the TOML file beat defaults; errors name the flag."""

import subprocess
import sys

import pytest

from aggregation.errors import ConfigError
from peer.config import PeerConfig, load_settings

BOOT = "/ip4/127.0.0.1/tcp/31337/p2p/QmdkQRh9vunbfpqzuFuwH2F1uKgPSeejQS6eM23ArdWdf7"


def test_precedence_flag_env_file_default(tmp_path, monkeypatch):
    config = tmp_path / "peer.toml"
    config.write_text('aggregator = "median"\nbatch_size = 16\nlr = 0.3\nrun_id = "from-file"\n')
    monkeypatch.setenv("PHALANX_BATCH_SIZE", "24")
    monkeypatch.setenv("PHALANX_LR", "0.2")
    settings = load_settings(PeerConfig, {"lr": 0.1}, config)
    assert settings.lr == 0.1  # flag
    assert settings.batch_size == 24  # env over file
    assert settings.aggregator == "median" and settings.run_id == "from-file"  # file over default
    assert settings.compression == "none"  # default


def test_lists_accept_commas_and_spaces_from_env(monkeypatch):
    monkeypatch.setenv("PHALANX_INITIAL_PEERS", f"{BOOT}, {BOOT.replace('31337', '31338')}")
    settings = load_settings(PeerConfig, {})
    assert settings.initial_peers == [BOOT, BOOT.replace("31337", "31338")]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"aggregator": "nope"}, "--aggregator nope: unknown aggregator 'nope'; valid names: mean, centered_clip"),
        ({"aggregator": "trimmed_mean"}, "missing required parameter 'b' (parameters go in --aggregator-params"),
        ({"tau": -1}, "--tau: Input should be greater than 0 (got -1)"),
        ({"compression": "zip"}, "--compression: Input should be 'none', 'fp16' or '8bit' (got 'zip')"),
        ({"resume": True}, "--resume needs --checkpoint-dir"),
        ({"initial_peers": "notamaddr"}, "--initial-peers: 'notamaddr' is not a multiaddr"),
        ({"aggregator_params": "tau=abc"}, "--aggregator-params takes name=number pairs like tau=1, not 'tau=abc'"),
        ({"public_ip": "203.0.113.7"}, "--public-ip needs a fixed --port"),
        ({"device": "tpu"}, "--device: String should match pattern"),
        ({"aggregator": "clipped_gossip", "tau": 1.0}, "use it with --mode gossip (or lasgd)"),
        ({"aggregator": "clipped_gossip", "mode": "gossip"}, "takes exactly one parameter, tau"),
        ({"sync_policy": "k:0"}, "--sync-policy / --slowdown"),
        ({"verify": True, "aggregator": "centered_clip", "tau": 1.0, "compression": "8bit"}, "--verify needs --compression none or fp16"),
        ({"verify": True, "aggregator": "centered_clip", "tau": 1.0, "mode": "lasgd"}, "--verify runs BTARD-SGD and needs --mode sync"),
        ({"upload_limit_mbps": -1}, "--upload-limit-mbps: Input should be greater than or equal to 0"),
        (
            {"aggregator": "bucketing", "aggregator_params": "s=2,inner=nope"},
            "inner: unknown aggregator 'nope'; valid names: mean, centered_clip, median, trimmed_mean, krum, multi_krum, geometric_median (",
        ),
        ({"aggregator": "bucketing", "aggregator_params": "s=two,inner=mean"}, "not 's=two' (--aggregator bucketing takes a name for inner)"),
        ({"aggregator": "centered_clip", "aggregator_params": "tau=mean"}, "--aggregator-params takes name=number pairs like tau=1, not 'tau=mean'"),
    ],
)
def test_errors_name_the_flag(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_settings(PeerConfig, overrides)
    assert message in str(info.value)


def test_bucketing_takes_its_inner_rule_by_name():
    import torch

    from aggregation.bucketing import bucketing
    from aggregation.coordinatewise import coordinate_median

    settings = load_settings(PeerConfig, {"aggregator": "bucketing", "aggregator_params": "s=2, inner=median, seed=5"})
    assert settings.aggregator_kwargs() == (("inner", "median"), ("s", 2.0), ("seed", 5.0))
    reduce = settings.round_config().make_reducer()  # what every reducer of a round runs
    x = torch.randn(7, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = bucketing(x, 2, coordinate_median, generator=torch.Generator().manual_seed(5)).value
    assert torch.equal(reduce(x, None), expected)
    other = load_settings(PeerConfig, {"aggregator": "bucketing", "aggregator_params": "s=2,inner=mean,seed=5"})
    assert other.run_hash() != settings.run_hash()


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--config: no such file"):
        load_settings(PeerConfig, {}, tmp_path / "absent.toml")


def test_run_hash_covers_protocol_fields_only():
    base = load_settings(PeerConfig, {})
    assert load_settings(PeerConfig, {"checkpoint_dir": "/tmp/x", "eval_every": 3}).run_hash() == base.run_hash()
    for change in ({"aggregator": "median"}, {"lr": 0.5}, {"compression": "fp16"}, {"run_id": "other"}, {"tau": 2.0, "aggregator": "centered_clip"}):
        assert load_settings(PeerConfig, change).run_hash() != base.run_hash(), change


def test_cli_prints_one_line_and_exits_2_on_a_user_mistake():
    result = subprocess.run(
        [sys.executable, "-m", "peer.cli", "join", "--aggregator", "nope"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --aggregator nope: unknown aggregator")


def test_cli_names_valid_inner_rules_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "peer.cli", "join", "--aggregator", "bucketing", "--aggregator-params", "s=2,inner=meen"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "inner: unknown aggregator 'meen'; valid names: mean, centered_clip" in lines[0], lines


def test_every_command_has_help_with_examples():
    for command in (["bootstrap"], ["join"], ["swarm"], ["bench", "aggregate"], ["bench", "allreduce"], ["bench", "swarm"]):
        result = subprocess.run(
            [sys.executable, "-m", "peer.cli", *command, "--help"], capture_output=True, text=True, timeout=120,
            env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        )
        assert result.returncode == 0, result.stderr
        assert "Examples" in result.stdout and "phalanx " + " ".join(command) in result.stdout, command
