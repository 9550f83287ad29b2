"""One settings model for a peer: CLI flags, `PHALANX_*` environment variables and a TOML file.

Precedence: flag > environment > config file > default. Every field is also a flag
(`initial_peers` → `--initial-peers`) and an environment variable
(`PHALANX_INITIAL_PEERS`); lists accept commas or spaces. Components never see PeerConfig:
peer.plan turns it once into a plan of per-component sections and parsed rules.
"""

from __future__ import annotations

import contextvars
import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from phalanx.aggregation.names import AGGREGATOR_NAMES
from phalanx.aggregation.spec import aggregator_params, parse_aggregator_params, parse_params, parse_spec
from phalanx.errors import ConfigError
from phalanx.peer.modes import MODES, modes_help
from phalanx.protocol.config import Codec, MatchmakingConfig, RoundConfig, topk_fraction, verify_config_for

PROTOCOL_VERSION = 3
BUILTIN_TASKS = ("digits-mlp", "mnist-cnn", "cifar10-resnet18", "tiny-gpt")
"""phalanx.tasks.TASKS's names (a test keeps them equal): known here without importing torch."""
ENV_PREFIX = "PHALANX_"
_config_data: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("phalanx_config_data", default=None)
# False while phalanx.Optimizer builds its settings: they are its arguments, never PHALANX_* variables
_read_environment: contextvars.ContextVar[bool] = contextvars.ContextVar("phalanx_read_environment", default=True)

StrList = Annotated[list[str], NoDecode]
S = TypeVar("S", bound=BaseSettings)
PARAMS_HINT = "(parameters: --aggregator NAME:name=value,… or --aggregator-params name=value,…)"


class NetworkSettings(BaseSettings):
    """Flags shared by every command that starts a DHT peer (bootstrap, join, health, ...)."""

    model_config = SettingsConfigDict(env_prefix="PHALANX_", extra="forbid", validate_default=True)

    initial_peers: StrList = Field(default_factory=list, description="Comma-separated multiaddrs of running peers to join through (printed by `phalanx bootstrap`).")
    initial_peers_wait_s: float = Field(0.0, ge=0.0, le=3600.0, description="Keep trying --initial-peers this long before giving up (peers started together; 0: try once).")
    host_maddrs: StrList = Field(default_factory=list, description="Multiaddrs to listen on; default /ip4/0.0.0.0/tcp/<port>.")
    port: int = Field(0, ge=0, le=65535, description="TCP port for libp2p when --host-maddrs is not given (0: any free port).")
    announce_maddrs: StrList = Field(default_factory=list, description="Multiaddrs other peers should dial (e.g. behind port forwarding).")
    public_ip: Optional[str] = Field(None, description="Announce /ip4/<public-ip>/tcp/<port>; needs a fixed --port.")
    identity_path: Optional[Path] = Field(None, description="Private key file fixing this peer's ID; created if missing. Never share one between peers.")
    use_relay: bool = Field(True, description="Allow reaching and being reached through libp2p circuit relays.")
    use_auto_relay: bool = Field(False, description="Look for relays to become reachable when behind NAT.")
    relay_budget_gb: float = Field(4.0, ge=0.0, le=1e6, description="As a swarm's entry point (no --initial-peers): relay up to this many GB each way per relayed connection for peers nobody can dial (0: relay nobody).")
    client_mode: bool = Field(False, description="Do not accept incoming DHT connections (behind NAT without relays).")
    direct_port: int = Field(0, ge=0, le=65535, description="TCP port for the direct tensor path (0: any free port).")
    direct: bool = Field(True, description="Move bulk tensor bytes over direct TCP when reachable (libp2p streams otherwise).")
    upload_limit_mbps: float = Field(0.0, ge=0.0, le=1e6, description="Cap this peer's bulk uploads (tensor parts, aggregates, state) at this many Mbit/s (0: no cap).")
    run_id: str = Field("phalanx", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="Swarm name; peers with another run id never meet.")
    http_port: int = Field(0, ge=0, le=65535, description="Serve /healthz, /readyz, /metrics and /api/v1/status on this TCP port (0: no HTTP server).")
    http_host: str = Field("127.0.0.1", min_length=1, max_length=253, description="Address the HTTP server binds (0.0.0.0 in containers).")

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [x for x in re.split(r"[\s,]+", value) if x]
        if isinstance(value, (list, tuple)):
            return [y for x in value for y in re.split(r"[\s,]+", str(x)) if y]
        return value

    @model_validator(mode="after")
    def _check(self) -> NetworkSettings:
        if self.public_ip is not None and self.port == 0 and not self.host_maddrs:
            raise ValueError("--public-ip needs a fixed --port (not 0) so others can dial it")
        for flag, addrs in (("--initial-peers", self.initial_peers), ("--host-maddrs", self.host_maddrs), ("--announce-maddrs", self.announce_maddrs)):
            for addr in addrs:
                _check_maddr(flag, addr)
        return self

    def listen_maddrs(self) -> list[str]:
        return self.host_maddrs or [f"/ip4/0.0.0.0/tcp/{self.port}"]

    def announce(self) -> list[str]:
        extra = [f"/ip4/{self.public_ip}/tcp/{self.port}"] if self.public_ip else []
        return list(self.announce_maddrs) + extra

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings]
        if _read_environment.get():
            sources.append(env_settings)
        data = _config_data.get()
        if data is not None:
            sources.append(InitSettingsSource(settings_cls, init_kwargs=data))
        return tuple(sources)


class PeerConfig(NetworkSettings):
    """Everything `phalanx join` needs."""

    task: str = Field("digits-mlp", description=f"Built-in task ({', '.join(BUILTIN_TASKS)}) or package.module:factory for your own.")
    data_dir: Optional[Path] = Field(None, description="Where the task's data files are (mnist-cnn, cifar10-resnet18).")
    data_file: Optional[Path] = Field(None, description="tiny-gpt: the text file to train on (default: this Python's standard-library source).")
    task_options: str = Field("", description="Options of the task's factory as name=value,... (tiny-gpt: dim, layers, heads, context).")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto, cpu, cuda or cuda:N.")
    mode: Literal[tuple(MODES)] = Field("sync", description=modes_help())  # peer/modes: the registry
    sync_every: int = Field(10, ge=1, description="lasgd/gossip: start an exchange every H local steps (H).")
    staleness: Literal["gap_aware", "sa", "dc", "none"] = Field("gap_aware", description="lasgd/gossip: how a contribution from an older base is corrected before averaging.")
    dana: bool = Field(False, description="lasgd/gossip: compute gradients at DANA's look-ahead position θ − η·γ·v (momentum lives on the peer).")
    max_gap: int = Field(8, ge=1, description="lasgd/gossip: a peer more than this many versions behind downloads the current model instead of contributing.")
    average_optimizer_state: bool = Field(False, description="lasgd/gossip: also average the momentum buffers (default: they stay local).")
    inner_steps: int = Field(50, ge=1, le=100_000, description="diloco: local steps of the inner optimizer between two outer steps (H).")
    outer_lr: float = Field(0.7, gt=0, le=10, description="diloco: the outer Nesterov step's learning rate (η).")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="diloco: the outer Nesterov step's momentum (μ).")
    overlap: Literal["on", "off"] = Field("off", description="diloco: run an outer step's round while the next inner steps train (on; off: wait for it).")
    phase_warmup: int = Field(10, ge=0, le=100_000, description="diloco with --verify: every phase starts from a fresh inner optimizer state, and its learning rate ramps up linearly again over this many inner steps (0: no ramp).")
    sync_policy: str = Field("full", description="How many peers a round waits for: full, k:<K>, hybrid:<linear|exp>:<T>, adasync:<K0>:<T0>.")
    async_window_s: float = Field(0.3, gt=0, description="lasgd/gossip: how long a forming group waits for more peers after the first one is ready.")
    slowdown: Optional[str] = Field(None, description="Delay each local step (a straggler for demos and tests): const:S, exp:M, shifted-exp:S:M, pareto:S:A.")
    batch_size: Optional[int] = Field(None, ge=1, description="Samples per peer per step (default: the task's).")
    lr: Optional[float] = Field(None, gt=0, description="Learning rate (default: the task's).")
    momentum: Optional[float] = Field(None, ge=0, lt=1, description="SGD momentum (default: the task's).")
    weight_decay: Optional[float] = Field(None, ge=0, description="SGD weight decay (default: the task's).")
    seed: int = Field(0, ge=0, description="Seed of the initial model and of every peer's minibatches.")
    steps: Optional[int] = Field(None, ge=1, description="Stop after this many steps (default: run until stopped).")
    target_accuracy: Optional[float] = Field(None, gt=0, le=1, description="Stop once test accuracy reaches this (tasks judged by accuracy: digits-mlp, mnist-cnn, cifar10-resnet18).")
    target_loss: Optional[float] = Field(None, gt=0, description="Stop once the validation loss is at most this (tasks judged by loss: tiny-gpt).")
    eval_every: int = Field(25, ge=1, description="Evaluate on the test split every N steps (diloco: of θ_t; a due evaluation waits for the next outer step rather than repeat the last).")
    aggregator: str = Field("mean", description=f"Rule each reducer applies, with parameters as NAME:name=value,... (e.g. bucketing:s=2,inner=mean): {', '.join(AGGREGATOR_NAMES)}; clipped_gossip (gossip/lasgd: each member gets its own clipped average).")
    tau: Optional[float] = Field(None, gt=0, description="Clipping radius for centered_clip (shorthand for --aggregator-params tau=…).")
    aggregator_params: str = Field("", description="Extra aggregator parameters as name=value pairs, e.g. 'tau=1,max_iter=100'; bucketing: 's=2,inner=mean' (inner: the rule applied to the bucket means). Not together with --aggregator NAME:params.")
    compression: str = Field("none", description="Codec for tensors on the wire: none, fp16, 8bit, int8 (per-block scales and a strict error bound: verified rounds take it) or topk:<fraction> (diloco, lasgd, gossip: the largest entries of what a peer sends, the rest kept as error feedback).")
    min_group_size: int = Field(1, ge=1, description="Fewest peers a round may close with at its deadline.")
    target_group_size: Optional[int] = Field(None, ge=2, description="lasgd: most peers per exchange (default: everyone ready).")
    group_size: Optional[int] = Field(None, ge=2, description="sync: most peers per group. A larger swarm splits every step into random groups of at most G that average their models besides their gradients, and finishes with rounds that bring every peer onto one model (docs/algorithms.md §11). Default: one group of every peer.")
    matchmaking_timeout_s: float = Field(5.0, gt=0, description="How long a leader waits for expected peers.")
    allreduce_timeout_s: float = Field(30.0, gt=0, description="Reducers drop members whose part has not arrived by then.")
    part_idle_timeout_s: float = Field(5.0, ge=0, description="Drop a member (or reducer) from a round once none of its part's bytes moved for this long at most, or its connection broke, instead of waiting out --allreduce-timeout-s. Each member's own limit is learned from its last rounds, at least 2 s (docs/algorithms.md §10); 0 turns this off.")
    checkpoint_dir: Optional[Path] = Field(None, description="Save model + optimizer + step here (atomically).")
    checkpoint_every: int = Field(100, ge=1, description="Checkpoint every N steps (and on clean shutdown).")
    checkpoint_keep: int = Field(3, ge=1, description="How many of the newest checkpoints to keep.")
    resume: bool = Field(False, description="Continue from the newest checkpoint in --checkpoint-dir.")
    wait_for_peers: int = Field(1, ge=1, description="Before the first step, wait (up to a minute) until this many trainers are announced; avoids a ragged start.")
    torch_threads: Optional[int] = Field(None, ge=1, description="Threads torch may use in this process.")
    events: bool = Field(False, description="Print one JSON progress event per line on stdout (used by `phalanx swarm`).")
    verify: bool = Field(False, description="Byzantine-tolerant rounds (BTARD): commitments, MPRNG, projection checks, validators, bans. Needs --mode sync or diloco, --aggregator centered_clip or mean, and --compression none, fp16 or int8.")
    validators: int = Field(1, ge=0, le=8, description="With --verify: members per round that each recompute another member's gradient (one training step each; no two check the same member). diloco: members (at most a third of the round's) the round's seed draws to sit the next phase out, each replaying the H inner steps of a member it picks in secret instead of training.")
    phase_timeout_s: float = Field(10.0, gt=0, description="With --verify: how long each verification phase waits for the others (diloco: the phases after validators' and judges' replays wait twice this peer's own phase of inner steps longer).")
    admission: Optional[Path] = Field(None, description="Private swarm: the owner's public key (from `phalanx keygen --owner`); peers without a valid certificate are refused.")
    certificate: Optional[Path] = Field(None, description="Private swarm: this peer's certificate (from `phalanx admit`).")
    attack: Optional[str] = Field(None, description="Make this peer an attacker (tests and demos): sign_flip, random_direction, label_flip, delayed, ipm, alie, nan, wrong_aggregate, equivocate, false_report, false_accusation, withhold_reveal, bad_commitment, silent, inflate_weight, withhold_aggregate, false_dispute, leave_out, deflate_weight, cover_up, equivocate_report, withhold_report, poison_state, oversized_part.")

    @field_validator("compression")
    @classmethod
    def _a_compression(cls, value: str) -> str:
        if value.startswith("topk:"):
            try:
                topk_fraction(value)
            except ValueError:
                raise ValueError("the fraction must be a number in (0, 1], like topk:0.01") from None
        elif value not in ("none", "fp16", "8bit", "int8"):
            raise ValueError("Input should be 'none', 'fp16', '8bit', 'int8' or 'topk:<fraction>'")
        return value

    @property
    def topk_fraction(self) -> Optional[float]:
        """--compression topk:<fraction>'s fraction (None for the other codecs)."""
        return topk_fraction(self.compression)

    @field_validator("task_options")
    @classmethod
    def _task_options_are_pairs(cls, value: str) -> str:
        try:
            parse_params(value)
        except ValueError as e:
            raise ValueError(f"{str(e)!r} is not name=value; write options as name=value,name=value") from None
        return value

    @model_validator(mode="after")
    def _check_peer(self) -> PeerConfig:
        if ":" not in self.task and self.task not in BUILTIN_TASKS:
            raise ValueError(f"--task {self.task}: not a built-in task; use one of {', '.join(BUILTIN_TASKS)}, or package.module:factory for your own")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.checkpoint_dir is not None and self.checkpoint_dir.exists() and not self.checkpoint_dir.is_dir():
            raise ValueError(f"--checkpoint-dir: {str(self.checkpoint_dir)!r} is a file, not a folder; give a folder (created if missing)")
        if self.target_group_size is not None and self.target_group_size < self.min_group_size:
            raise ValueError("--target-group-size must be ≥ --min-group-size")
        if (self.admission is None) != (self.certificate is None):
            raise ValueError("--admission and --certificate go together (a private swarm needs both)")
        for flag, path in (("--admission", self.admission), ("--certificate", self.certificate)):
            if path is not None and not path.is_file():
                raise ValueError(f"{flag}: no such file {str(path)!r}")
        if self.verify and not MODES[self.mode].lockstep:
            raise ValueError(
                "--verify runs BTARD-SGD and needs --mode sync or diloco: asynchronous exchanges weight stale "
                "contributions, which the fixed-point check cannot tell from tampering"
            )
        if self.verify and self.mode == "diloco" and self.overlap == "on":
            raise ValueError(
                "--verify with --mode diloco needs --overlap off: validators recompute a peer's H inner steps "
                "from θ_t, and overlapped steps start from the peer's own estimate of θ_t+1"
            )
        if self.topk_fraction is not None and self.mode == "sync":
            raise ValueError(
                f"--compression {self.compression} needs --mode diloco, lasgd or gossip (error feedback on a peer's "
                "progress since the last exchange); use int8 with --mode sync"
            )
        if self.topk_fraction is not None and self.average_optimizer_state:
            raise ValueError(
                f"--compression {self.compression} with --average-optimizer-state: the momentum buffers would go "
                "dense beside the sparse progress; leave them local, or use int8"
            )
        if self.verify and self.topk_fraction is not None:
            raise ValueError(
                f"--verify with --compression {self.compression}: what a peer sends depends on its error-feedback "
                "residual, which validators cannot recompute; use int8 for verified rounds"
            )
        if self.verify and self.compression == Codec.UINT8.value:
            raise ValueError(
                "--verify needs --compression none, fp16 or int8: 8-bit codebooks can move an honest aggregate "
                "further than the projection check can tell from tampering"
            )
        if self.aggregator_name == "clipped_gossip" and MODES[self.mode].lockstep:
            raise ValueError("--aggregator clipped_gossip gives every member its own result: use it with --mode gossip (or lasgd)")
        if self.group_size is not None:
            self._check_group_size()
        fixed = MODES[self.mode].group_size
        if fixed is not None and self.target_group_size not in (None, fixed):
            raise ValueError(f"--mode {self.mode} works in groups of {fixed}: drop --target-group-size")
        return self

    def _check_group_size(self) -> None:
        if self.mode != "sync":
            other = "--target-group-size sizes lasgd exchanges" if self.mode == "lasgd" else "it runs one group"
            raise ValueError(f"--group-size splits --mode sync rounds; with --mode {self.mode} {other}: drop --group-size")
        if self.target_group_size is not None:
            raise ValueError("--target-group-size is for lasgd; with --mode sync give --group-size alone")
        if self.verify:
            raise ValueError("--group-size with --verify: verified rounds run in one group of every peer for now; drop --group-size")
        if self.compression != Codec.NONE.value:
            raise ValueError(
                f"--group-size averages the models themselves, which --compression {self.compression} would round "
                "(every peer's parameters off by the codec's error each step): use --compression none"
            )

    @property
    def aggregator_name(self) -> str:
        """The rule's name from --aggregator NAME[:k=v,...]."""
        return self.aggregator.partition(":")[0].strip()

    def aggregator_spec(self) -> tuple[str, tuple[tuple[str, float | str], ...]]:
        """(name, sorted parameters) from --aggregator NAME[:k=v,...], --aggregator-params and --tau."""
        if ":" in self.aggregator and self.aggregator_params.strip():
            raise ConfigError(
                f"--aggregator {self.aggregator} and --aggregator-params {self.aggregator_params} both give "
                "parameters: keep one of them"
            )
        try:
            if ":" in self.aggregator:
                name, params = parse_spec(self.aggregator, "--aggregator")
                kwargs = dict(aggregator_params(params, name, "--aggregator"))
            else:
                name = self.aggregator_name
                kwargs = dict(parse_aggregator_params(self.aggregator_params, name))
        except ConfigError as e:
            raise self._aggregator_error(e) from None
        if self.tau is not None:
            kwargs["tau"] = self.tau
        return name, tuple(sorted(kwargs.items()))

    def round_config(self, aggregator: str, params: tuple[tuple[str, float | str], ...]) -> RoundConfig:
        """The round every peer of the run runs, for the parsed `aggregator_spec()` (see peer.plan)."""
        if self.verify and aggregator == "centered_clip" and "tau" not in dict(params):
            raise ConfigError(
                "--verify with --aggregator centered_clip needs --tau (the clipping radius every reducer and "
                "verifier must share, e.g. --tau 1)"
            )
        try:
            asynchronous = not MODES[self.mode].lockstep
            matchmaking = MatchmakingConfig(
                min_group_size=max(self.min_group_size, 2) if asynchronous else self.min_group_size,
                target_group_size=MODES[self.mode].group_size or self.target_group_size,
                matchmaking_timeout_s=self.matchmaking_timeout_s,
                join_timeout_s=max(60.0, 4 * self.matchmaking_timeout_s),
                lockstep=not asynchronous,
                window_s=self.async_window_s if asynchronous else None,
                group_size=self.group_size,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            config = RoundConfig(
                matchmaking=matchmaking,
                aggregator=aggregator,
                aggregator_params=params,
                compression=Codec.parse(self.compression),
                allreduce_timeout_s=self.allreduce_timeout_s,
                part_idle_timeout_s=self.part_idle_timeout_s or None,
                verify=(
                    verify_config_for(
                        aggregator, params, phase_timeout_s=self.phase_timeout_s, validators=self.validators,
                        validators_sit_out=self.mode == "diloco",
                    )
                    if self.verify
                    else None
                ),
            )
            config.make_reducer()  # unknown names and bad parameters fail here, with the valid choices listed
        except ConfigError as e:
            raise self._aggregator_error(e) from None
        return config

    def _aggregator_error(self, e: ConfigError) -> ConfigError:
        """One line that names --aggregator once: the registry's and the parser's own prefixes go."""
        detail = str(e).removeprefix(f"aggregator {self.aggregator_name!r}: ")
        if detail.startswith("--aggregator takes "):  # from the NAME:k=v form
            detail = "parameters are " + detail.removeprefix("--aggregator takes ")
        return ConfigError(f"--aggregator {self.aggregator}: {detail} {PARAMS_HINT}")


class MonitorSettings(NetworkSettings):
    """Everything `phalanx monitor` needs (here beside the others: known_settings lists every command's)."""

    http_port: int = Field(8000, ge=1, le=65535, description="Serve the dashboard on this TCP port.")
    poll_s: float = Field(2.0, ge=0.2, le=60, description="Read every peer's health record this often (seconds).")
    history_points: int = Field(
        1800, ge=10, le=100_000, description="Polls kept for the plots (1800 × 2 s = one hour)."
    )


def load_settings(model: type[NetworkSettings], overrides: dict[str, Any], config_file: Optional[Path] = None):
    """Build `model` from flags (`overrides`), environment and `config_file`; an error names where the
    bad value came from: the flag, the PHALANX_* variable or the file's key."""
    data = read_config_file(model, config_file) if config_file is not None else None
    token = _config_data.set(data)
    try:
        return model(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if not first["loc"]:  # a cross-field rule: its message names the flags itself
            raise ConfigError(message) from None
        field = str(first["loc"][0])
        raise ConfigError(f"{_source(field, overrides, config_file, data)}: {message} (got {first.get('input')!r})") from None
    except ConfigError:
        raise
    finally:
        _config_data.reset(token)


def settings_from_arguments(model: type[S], fields: dict[str, Any]) -> S:
    """`model` from `fields` alone: the library's settings are its arguments, so a PHALANX_* variable
    meant for the command line (a container's, a shell's) never changes a script's run."""
    token = _read_environment.set(False)
    try:
        return model(**fields)
    finally:
        _read_environment.reset(token)


def read_config_file(model: type[NetworkSettings], path: Path) -> dict[str, Any]:
    """The TOML file's settings by field name. Keys are the flags' names without `--`, with `_` or `-`
    (`batch_size` or `batch-size`); a key that is no setting of `model` is refused, naming the file."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {str(path)!r}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config: cannot read {str(path)!r} ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e}); write one `name = value` per line") from None
    data: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in data:
            raise ConfigError(f"--config {path}: {key!r} is given twice (as {name!r} too); keep one")
        if name not in model.model_fields:
            raise ConfigError(f"--config {path}: {_unknown(key, name, model)}")
        data[name] = value
    return data


def _unknown(key: str, name: str, model: type[NetworkSettings]) -> str:
    if name in known_settings():
        return f"{key!r} is not a setting of this command; remove it or keep a separate file per command"
    close = difflib.get_close_matches(name, list(model.model_fields), n=1)
    hint = f"did you mean {close[0]!r}?" if close else "see `phalanx <command> --help` (keys are flag names without --)"
    return f"unknown key {key!r} ({hint})"


def _source(field: str, overrides: dict[str, Any], config_file: Optional[Path], data: Optional[dict]) -> str:
    """Where `field`'s value came from, as the user wrote it (flag > environment > file)."""
    flag = "--" + field.replace("_", "-")
    if field in overrides:
        return flag
    env = ENV_PREFIX + field.upper()
    if any(name.upper() == env for name in os.environ):
        return f"{env} (the environment variable of {flag})"
    if data is not None and field in data:
        return f"--config {config_file}: key {field}"
    return flag


# PHALANX_* variables read by others than the settings models: the root command's --log-format and
# the container entry point (scripts/docker-entrypoint.py) and docker-compose.yml.
OTHER_ENV_VARS = ("LOG_FORMAT", "BOOTSTRAP_URL", "BOOTSTRAP_WAIT_S", "REPLICA_DIR", "IMAGE", "MONITOR_PORT")


def known_settings() -> set[str]:
    """Every field name of every command's settings model."""
    return set(PeerConfig.model_fields) | set(MonitorSettings.model_fields)


def environment_settings(environ: Optional[dict[str, str]] = None) -> list[str]:
    """The PHALANX_* variables set that name a setting of `phalanx join` (what the library ignores)."""
    environ = os.environ if environ is None else environ
    names = {ENV_PREFIX + name.upper() for name in PeerConfig.model_fields}
    return sorted(name for name in environ if name.upper() in names)


def misspelt_env_vars(environ: Optional[dict[str, str]] = None) -> list[tuple[str, Optional[str]]]:
    """(name, closest valid name or None) for each PHALANX_* variable nobody reads: a typo there
    would otherwise be ignored without a word."""
    environ = os.environ if environ is None else environ
    valid = [ENV_PREFIX + name.upper() for name in sorted(known_settings())] + [ENV_PREFIX + n for n in OTHER_ENV_VARS]
    found = []
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX) and upper not in valid:
            close = difflib.get_close_matches(upper, valid, n=1, cutoff=0.6)
            found.append((name, close[0] if close else None))
    return found


def _check_maddr(flag: str, addr: str) -> None:
    from multiaddr import Multiaddr

    try:
        parsed = Multiaddr(addr)
    except Exception:
        raise ValueError(f"{flag}: {addr!r} is not a multiaddr (like /ip4/1.2.3.4/tcp/31337/p2p/Qm...)") from None
    if flag == "--initial-peers" and "p2p" not in {p.name for p in parsed.protocols()}:
        raise ValueError(
            f"--initial-peers: {addr!r} lacks the /p2p/<peer-id> part; paste the whole address "
            "`phalanx bootstrap` printed (…/tcp/<port>/p2p/12D3KooW…)"
        )
