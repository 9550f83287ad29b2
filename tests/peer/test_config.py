"""One settings model: flags beat PHALANX_* env vars beat the TOML file beat defaults; errors name the flag."""

import pytest

from phalanx.errors import ConfigError
from phalanx.peer.config import PeerConfig, load_settings
from phalanx.peer.plan import make_plan

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
        ({"aggregator": "trimmed_mean"}, "missing required parameter 'b' (parameters: --aggregator NAME:name=value"),
        ({"tau": -1}, "--tau: Input should be greater than 0 (got -1)"),
        ({"compression": "zip"}, "--compression: Input should be 'none', 'fp16', '8bit', 'int8' or 'topk:<fraction>' (got 'zip')"),
        ({"resume": True}, "--resume needs --checkpoint-dir"),
        ({"initial_peers": "notamaddr"}, "--initial-peers: 'notamaddr' is not a multiaddr"),
        ({"aggregator_params": "tau=abc"}, "--aggregator-params takes name=number pairs like tau=1, not 'tau=abc'"),
        ({"public_ip": "203.0.113.7"}, "--public-ip needs a fixed --port"),
        ({"device": "tpu"}, "--device: String should match pattern"),
        ({"aggregator": "clipped_gossip", "tau": 1.0}, "use it with --mode gossip (or lasgd)"),
        ({"aggregator": "clipped_gossip", "mode": "gossip"}, "takes exactly one parameter, tau"),
        ({"sync_policy": "k:0"}, "--sync-policy / --slowdown"),
        ({"verify": True, "aggregator": "centered_clip", "tau": 1.0, "compression": "8bit"}, "--verify needs --compression none, fp16 or int8"),
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
        make_plan(load_settings(PeerConfig, overrides))  # the rules that need parsing are checked by the plan
    assert message in str(info.value)


def test_bucketing_takes_its_inner_rule_by_name():
    import torch

    from phalanx.aggregation.bucketing import bucketing
    from phalanx.aggregation.coordinatewise import coordinate_median

    settings = load_settings(PeerConfig, {"aggregator": "bucketing", "aggregator_params": "s=2, inner=median, seed=5"})
    assert settings.aggregator_spec() == ("bucketing", (("inner", "median"), ("s", 2.0), ("seed", 5.0)))
    reduce = make_plan(settings).round.make_reducer()  # what every reducer of a round runs
    x = torch.randn(7, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = bucketing(x, 2, coordinate_median, generator=torch.Generator().manual_seed(5)).value
    assert torch.equal(reduce(x, None), expected)
    other = load_settings(PeerConfig, {"aggregator": "bucketing", "aggregator_params": "s=2,inner=mean,seed=5"})
    assert make_plan(other).run_hash != make_plan(settings).run_hash


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--config: no such file"):
        load_settings(PeerConfig, {}, tmp_path / "absent.toml")


def test_run_hash_covers_protocol_fields_only():
    base = _run_hash({})
    assert _run_hash({"checkpoint_dir": "/tmp/x", "eval_every": 3}) == base
    for change in ({"aggregator": "median"}, {"lr": 0.5}, {"compression": "fp16"}, {"run_id": "other"}, {"tau": 2.0, "aggregator": "centered_clip"}):
        assert _run_hash(change) != base, change


def _run_hash(overrides) -> bytes:
    return make_plan(load_settings(PeerConfig, overrides)).run_hash


# Every PeerConfig field: (settings before, settings after) a change of it, and whether the change must
# change run_hash. A field added to PeerConfig fails test_every_field_is_hashed_or_local until it is here.
CC = {"aggregator": "centered_clip", "tau": 1.0}
VERIFY = {**CC, "verify": True}
LASGD = {"mode": "lasgd"}
DILOCO = {"mode": "diloco"}
HASHED = {
    "inner_steps": (DILOCO, {**DILOCO, "inner_steps": 10}),
    "outer_lr": (DILOCO, {**DILOCO, "outer_lr": 1.0}),
    "outer_momentum": (DILOCO, {**DILOCO, "outer_momentum": 0.5}),
    "overlap": (DILOCO, {**DILOCO, "overlap": "on"}),
    "phase_warmup": (DILOCO, {**DILOCO, "phase_warmup": 5}),
    "run_id": ({}, {"run_id": "other"}),
    "task": ({}, {"task": "mnist-cnn"}),
    "task_options": ({}, {"task_options": "hidden=32"}),
    "mode": ({}, {"mode": "lasgd"}),
    "sync_every": (LASGD, {**LASGD, "sync_every": 5}),
    "staleness": (LASGD, {**LASGD, "staleness": "sa"}),
    "dana": (LASGD, {**LASGD, "dana": True}),
    "average_optimizer_state": ({}, {"average_optimizer_state": True}),
    "sync_policy": ({}, {"sync_policy": "k:2"}),
    "async_window_s": (LASGD, {**LASGD, "async_window_s": 1.0}),
    "batch_size": ({}, {"batch_size": 16}),
    "lr": ({}, {"lr": 0.5}),
    "momentum": ({}, {"momentum": 0.5}),
    "weight_decay": ({}, {"weight_decay": 0.1}),
    "seed": ({}, {"seed": 1}),
    "aggregator": ({}, {"aggregator": "median"}),
    "tau": (CC, {**CC, "tau": 2.0}),
    "aggregator_params": ({"aggregator": "trimmed_mean", "aggregator_params": "b=1"}, {"aggregator": "trimmed_mean", "aggregator_params": "b=2"}),
    "compression": ({}, {"compression": "fp16"}),
    "min_group_size": ({}, {"min_group_size": 2}),
    "target_group_size": ({}, {"target_group_size": 4}),
    "group_size": ({}, {"group_size": 4}),
    "matchmaking_timeout_s": ({}, {"matchmaking_timeout_s": 7.0}),
    "allreduce_timeout_s": ({}, {"allreduce_timeout_s": 40.0}),
    "part_idle_timeout_s": ({}, {"part_idle_timeout_s": 9.0}),  # when reducers drop a sender whose bytes stopped
    "verify": (CC, VERIFY),
    "validators": (VERIFY, {**VERIFY, "validators": 2}),
    "phase_timeout_s": (VERIFY, {**VERIFY, "phase_timeout_s": 20.0}),
    "admission": ("private", "other owner"),  # built from files in the test
}
LOCAL = {  # how this one peer connects, stores, reports and behaves; the swarm never depends on it
    "initial_peers": ({}, {"initial_peers": BOOT}),
    "initial_peers_wait_s": ({}, {"initial_peers_wait_s": 30.0}),
    "host_maddrs": ({}, {"host_maddrs": "/ip4/127.0.0.1/tcp/0"}),
    "port": ({}, {"port": 4000}),
    "announce_maddrs": ({}, {"announce_maddrs": "/ip4/203.0.113.7/tcp/4000"}),
    "public_ip": ({"port": 4000}, {"port": 4000, "public_ip": "203.0.113.7"}),
    "identity_path": ({}, {"identity_path": "/tmp/phalanx-test-id.key"}),
    "use_relay": ({}, {"use_relay": False}),
    "use_auto_relay": ({}, {"use_auto_relay": True}),
    "relay_budget_gb": ({}, {"relay_budget_gb": 0.5}),
    "client_mode": ({}, {"client_mode": True}),
    "direct_port": ({}, {"direct_port": 4001}),
    "direct": ({}, {"direct": False}),
    "upload_limit_mbps": ({}, {"upload_limit_mbps": 10.0}),
    "http_port": ({}, {"http_port": 8080}),
    "http_host": ({}, {"http_host": "0.0.0.0"}),
    "data_dir": ({}, {"data_dir": "/tmp/phalanx-test-data"}),
    "data_file": ({}, {"data_file": "/tmp/phalanx-test-corpus.txt"}),
    "device": ({}, {"device": "cpu"}),
    "max_gap": (LASGD, {**LASGD, "max_gap": 3}),  # when this peer resyncs instead of contributing
    "slowdown": ({}, {"slowdown": "const:0.1"}),
    "steps": ({}, {"steps": 10}),
    "target_accuracy": ({}, {"target_accuracy": 0.5}),
    "target_loss": ({}, {"target_loss": 1.5}),
    "eval_every": ({}, {"eval_every": 3}),
    "checkpoint_dir": ({}, {"checkpoint_dir": "/tmp/x"}),
    "checkpoint_every": ({}, {"checkpoint_every": 5}),
    "checkpoint_keep": ({}, {"checkpoint_keep": 5}),
    "resume": ({"checkpoint_dir": "/tmp/x"}, {"checkpoint_dir": "/tmp/x", "resume": True}),
    "wait_for_peers": ({}, {"wait_for_peers": 3}),
    "torch_threads": ({}, {"torch_threads": 2}),
    "events": ({}, {"events": True}),
    "certificate": ("private", "other certificate"),  # built from files in the test
    "attack": ({}, {"attack": "sign_flip"}),  # an attacker must be able to join (tests and demos)
}


def test_every_field_is_hashed_or_local(tmp_path):
    assert not set(HASHED) & set(LOCAL)
    unlisted = set(PeerConfig.model_fields) - set(HASHED) - set(LOCAL)
    assert not unlisted, f"PeerConfig fields {sorted(unlisted)}: hash them in run_hash (and list them in HASHED) or list them in LOCAL"
    for name, content in (("owner.pub", b"owner"), ("other.pub", b"other"), ("a.cert", b"a"), ("b.cert", b"b")):
        (tmp_path / name).write_bytes(content)
    private = {"admission": tmp_path / "owner.pub", "certificate": tmp_path / "a.cert"}
    files = {
        "private": private,
        "other owner": {**private, "admission": tmp_path / "other.pub"},
        "other certificate": {**private, "certificate": tmp_path / "b.cert"},
    }
    for table, hashed in ((HASHED, True), (LOCAL, False)):
        for name, (before, after) in table.items():
            before, after = (files[x] if isinstance(x, str) else x for x in (before, after))
            assert name in after and after != before, name
            a, b = _run_hash(before), _run_hash(after)
            assert (a != b) == hashed, f"--{name.replace('_', '-')}: {'left out of' if hashed else 'reaches'} run_hash"


def test_cli_prints_one_line_and_exits_2_on_a_user_mistake(phalanx_cli):
    result = phalanx_cli(["join", "--aggregator", "nope"])
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --aggregator nope: unknown aggregator")


def test_cli_names_valid_inner_rules_in_one_line(phalanx_cli):
    result = phalanx_cli(["join", "--aggregator", "bucketing", "--aggregator-params", "s=2,inner=meen"])
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "inner: unknown aggregator 'meen'; valid names: mean, centered_clip" in lines[0], lines


def test_every_command_has_help_with_examples(phalanx_cli):
    for command in (["bootstrap"], ["join"], ["swarm"], ["bench", "aggregate"], ["bench", "allreduce"], ["bench", "swarm"], ["bench", "diloco"]):
        result = phalanx_cli([*command, "--help"])
        assert result.returncode == 0, result.stderr
        assert "Examples" in result.stdout and "phalanx " + " ".join(command) in result.stdout, command


def test_bench_diloco_names_its_cases_in_a_one_line_error(phalanx_cli):
    result = phalanx_cli(["bench", "diloco", "--cases", "int8,verfy"])
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--cases int8,verfy: choose from sync, diloco, overlap, int8, verify" in lines[0], lines


@pytest.mark.parametrize("command", ["diloco", "inner-state"])
def test_bench_outer_lr_out_of_range_is_a_one_line_error(command, phalanx_cli):
    result = phalanx_cli(["bench", command, "--outer-lr", "0"])
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--outer-lr 0: use a value above 0 and at most 10" in lines[0], lines


@pytest.mark.parametrize("command", ["diloco", "inner-state"])
def test_bench_lr_at_zero_is_a_one_line_error(command, phalanx_cli):
    result = phalanx_cli(["bench", command, "--lr", "0"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "--lr 0: use a learning rate above 0" in lines[0], lines
