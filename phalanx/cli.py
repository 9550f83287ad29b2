"""`phalanx`: the command line. Each command parses flags, sets up logging and hands off.

User mistakes (ConfigError) print one line naming the field and the fix and exit 2;
tracebacks appear only with --debug.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from phalanx.errors import ConfigError, PhalanxError
from phalanx.peer.config import MonitorSettings, NetworkSettings, PeerConfig
from phalanx.peer.flags import PlainHelp, settings_command, settings_command_with, str_list
from phalanx.peer.logs import configure_logging

if TYPE_CHECKING:
    from phalanx.peer.plan import PeerPlan, TrainingConfig
    from phalanx.tasks.metric import Metric

app = typer.Typer(
    name="phalanx",
    help="Train one model on many volunteers' GPUs: Byzantine-tolerant, staleness-aware, peer to peer.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
from phalanx.sim.cli import sim_app  # noqa: E402  (imports only typer; the simulator loads when a command runs)
from phalanx.tools.bench.commands import bench_app  # noqa: E402  (imports only typer, like sim_app)

app.add_typer(bench_app, name="bench")

app.add_typer(sim_app, name="sim")

_state = {"debug": False}


@app.callback()
def _root(
    log_format: str = typer.Option("text", "--log-format", envvar="PHALANX_LOG_FORMAT", help="text or json (one JSON object per line)."),
    debug: bool = typer.Option(False, "--debug", help="Verbose logs and full tracebacks."),
) -> None:
    _state["debug"] = debug
    try:
        configure_logging(log_format, debug=debug)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--log-format") from None


@app.command("bootstrap", cls=PlainHelp)
@settings_command(NetworkSettings, exclude=("direct", "direct_port", "upload_limit_mbps"))
def bootstrap(settings: NetworkSettings) -> None:
    """Start a DHT-only peer that others join through; prints the exact --initial-peers line to use.

    [bold]Examples[/bold]

      phalanx bootstrap --identity-path bootstrap.id --port 31337

      phalanx bootstrap --identity-path b.id --port 31337 --public-ip 203.0.113.7
    """
    from phalanx.peer.bootstrap import run_bootstrap

    run_bootstrap(settings)


@app.command("join", cls=PlainHelp)
@settings_command(PeerConfig)
def join(settings: PeerConfig) -> None:
    """Join a swarm as a trainer: DHT, round engine and training loop. Stops on --steps, the target
    in the task's metric (--target-accuracy or --target-loss) or Ctrl-C (writing a final checkpoint
    when --checkpoint-dir is set).

    [bold]Examples[/bold]

      phalanx join --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...

      phalanx join --initial-peers ... --aggregator centered_clip:tau=1

      phalanx join --initial-peers ... --checkpoint-dir ckpt --resume

      PHALANX_INITIAL_PEERS=/ip4/... phalanx join --config peer.toml
    """
    from phalanx.peer.plan import make_plan
    from phalanx.peer.trainer import run_trainer
    from phalanx.tools.doctor import preflight

    plan = make_plan(settings)  # the settings' strings parsed once; the trainer gets the plan only
    preflight(settings)  # the doctor's checks that need no network: one line instead of a traceback
    if not settings.initial_peers:  # after the checks, so that a mistake stays one line
        typer.secho(
            "notice: no --initial-peers: this peer starts a new swarm of its own (the log shows the line others join it with)",
            err=True, fg="yellow",
        )  # fmt: skip
    report = run_trainer(plan)
    if (settings.target_accuracy is not None or settings.target_loss is not None) and not report.reached_target:
        raise typer.Exit(3)


@app.command("doctor", cls=PlainHelp)
@settings_command_with(
    PeerConfig,
    exclude=("initial_peers",),
    initial_peers=(Optional[list[str]], typer.Option(None, "--initial-peers", help="Comma-separated multiaddrs of running peers to check (each gets its own rows, malformed ones too). [env: PHALANX_INITIAL_PEERS]", show_default=False)),
    as_json=(bool, typer.Option(False, "--json", help="Print JSON ({ok, rows: [{check, status, detail, fix}]}) instead of a table.")),
)
def doctor(settings: PeerConfig, initial_peers: Optional[list[str]], as_json: bool) -> None:
    """Check everything `phalanx join` needs with the same flags, one row per check, each failed row
    with its fix: initial peers (address, TCP, libp2p, DHT ping), p2p daemon start, reachability from
    outside, ports, clock, protocol and run config against the swarm, task and data, the target flag
    against the task's metric, device, disk, identity. Exit 1 when a check failed.

    [bold]Examples[/bold]

      phalanx doctor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...

      phalanx doctor --initial-peers ... --task mnist-cnn --data-dir ~/data/mnist --json
    """
    import re

    from phalanx.peer.plan import make_plan
    from phalanx.tools.doctor import run_doctor

    config_hash = make_plan(settings).run_hash.hex()  # the same mistakes as `join` fail here, in one line
    given = [a for v in initial_peers or [] for a in re.split(r"[\s,]+", v) if a] or settings.initial_peers
    code = run_doctor(settings, given, as_json=as_json, config_hash=config_hash)
    if code:
        raise typer.Exit(code)


@app.command(
    "swarm",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def swarm(
    ctx: typer.Context,
    peers: int = typer.Option(4, "--peers", min=1, help="Trainer processes to start."),
    task: str = typer.Option("digits-mlp", "--task", help="Task every trainer trains."),
    steps: int = typer.Option(2000, "--steps", min=1, help="Step budget per trainer."),
    target_accuracy: Optional[float] = typer.Option(None, "--target-accuracy", min=0.0, max=1.0, help="Stop when a trainer's test accuracy reaches this (tasks judged by accuracy); exit 0 only if it does. Default: the task's own (0.95 for digits-mlp and mnist-cnn).", show_default=False),
    target_loss: Optional[float] = typer.Option(None, "--target-loss", min=0.0, help="Stop when a trainer's validation loss is at most this (tasks judged by loss: tiny-gpt); exit 0 only if it does. Default: none, and the --steps done are success.", show_default=False),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Keep logs, identities and checkpoints here (default: a temporary folder, removed at exit)."),
    byzantine: int = typer.Option(0, "--byzantine", min=0, help="How many of the --peers trainers attack."),
    attack: str = typer.Option("sign_flip", "--attack", help="Attack(s) of the Byzantine peers, comma-separated and cycled (see `phalanx join --help`)."),
    stragglers: int = typer.Option(0, "--stragglers", min=0, help="How many honest peers are slowed down by --slowdown."),
    slowdown: Optional[str] = typer.Option(None, "--slowdown", help="Delay per local step: of the stragglers, or of every peer without --stragglers (const:S, exp:M, shifted-exp:S:M, pareto:S:A)."),
) -> None:
    """Start a whole swarm on this machine (a bootstrap peer and N trainers on loopback), show live
    progress in the task's metric (test accuracy, or validation loss and perplexity), stop at the
    target or the step budget and print a report. Without a target, the steps done are success.

    Any other option is passed to every `phalanx join` (e.g. --aggregator centered_clip --tau 1).

    [bold]Examples[/bold]

      phalanx swarm --peers 4

      phalanx swarm --peers 3 --aggregator centered_clip --tau 1 --compression fp16

      phalanx swarm --peers 2 --task mnist-cnn --data-dir ~/data/mnist --target-accuracy 0.98

      phalanx swarm --peers 3 --task tiny-gpt --target-loss 2.6

      phalanx swarm --peers 9 --byzantine 3 --attack sign_flip,label_flip,wrong_aggregate --aggregator centered_clip --tau 1 --verify

      phalanx swarm --peers 4 --mode lasgd --stragglers 1 --slowdown shifted-exp:0.05:0.05
    """
    join_args = ["--task", task, "--steps", str(steps), "--wait-for-peers", str(peers), *ctx.args]
    for flag, value in (("--target-accuracy", target_accuracy), ("--target-loss", target_loss)):
        join_args += [flag, str(value)] if value is not None else []
    attacks = str_list(attack)
    if byzantine and not attacks:
        raise ConfigError("--attack needs at least one attack name with --byzantine")
    chosen = [attacks[i % len(attacks)] for i in range(byzantine)]
    if stragglers and slowdown is None:
        raise ConfigError("--stragglers needs --slowdown (how much slower they are)")
    slow_args = ["--slowdown", slowdown] if slowdown else []
    if not stragglers:
        join_args += slow_args
    plans = [
        _check_join_args([*join_args, *extra])  # one line now, not every trainer dying at start
        for extra in [[], *(["--attack", a] for a in sorted(set(chosen))), *([slow_args] if stragglers else [])]
    ]
    metric, target = _swarm_target(plans[0].training)
    if target is not None and target_accuracy is None and target_loss is None:
        join_args += [metric.flag, str(target)]  # the task's own target: the trainers stop at it too
    from phalanx.tools.launcher.swarm import run_swarm  # it imports torch: after the flags' mistakes

    result = run_swarm(
        peers, join_args, target=target, metric=metric, workdir=workdir, attacks=chosen,
        stragglers=stragglers, straggler_args=slow_args, debug=_state["debug"],
    )  # fmt: skip
    if not result.succeeded:
        raise typer.Exit(1)


@app.command("health", cls=PlainHelp)
@settings_command_with(
    NetworkSettings,
    exclude=("direct", "direct_port", "upload_limit_mbps", "http_port", "http_host", "client_mode", "port", "public_ip", "announce_maddrs", "relay_budget_gb"),
    as_json=(bool, typer.Option(False, "--json", help="Print JSON (every record, with the problems found) instead of a table.")),
    watch=(bool, typer.Option(False, "--watch", help="Keep polling: a live table, or one JSON line per poll with --json.")),
    interval_s=(float, typer.Option(2.0, "--interval-s", min=0.2, help="Seconds between polls.")),
    expect=(int, typer.Option(0, "--expect", min=0, help="Wait until at least this many peers are online; exit 1 if not by --timeout-s.")),
    timeout_s=(float, typer.Option(60.0, "--timeout-s", min=0, help="How long --expect waits.")),
)
def health(settings: NetworkSettings, as_json: bool, watch: bool, interval_s: float, expect: int, timeout_s: float) -> None:
    """Join the swarm as a client and print every peer's health: short ID, state, version, step,
    samples/s, last seen, relay/direct and the problems found (signed records from the DHT).

    [bold]Examples[/bold]

      phalanx health --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...

      phalanx health --initial-peers ... --watch

      phalanx health --initial-peers ... --json --expect 3 --timeout-s 120
    """
    if not settings.initial_peers:
        raise ConfigError(
            "--initial-peers: phalanx health reads the swarm through a running peer; give its address "
            "(the line `phalanx bootstrap` printed) or set PHALANX_INITIAL_PEERS"
        )
    from phalanx.tools.health_client import run_health

    code = run_health(settings, as_json=as_json, watch=watch, interval_s=interval_s, expect=expect, timeout_s=timeout_s)
    if code:
        raise typer.Exit(code)


@app.command("monitor", cls=PlainHelp)
@settings_command(MonitorSettings, exclude=("direct", "direct_port", "upload_limit_mbps", "client_mode", "public_ip", "announce_maddrs", "relay_budget_gb"))
def monitor(settings: MonitorSettings) -> None:
    """Serve a swarm dashboard: the peer table and plots of loss, accuracy, throughput and peers by
    state over time, a JSON API (/api/v1/status) and aggregated Prometheus /metrics.

    [bold]Examples[/bold]

      phalanx monitor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3...

      phalanx monitor --initial-peers ... --http-port 8000

      phalanx monitor --initial-peers ... --http-host 0.0.0.0 --poll-s 5
    """
    from phalanx.tools.monitor.app import run_monitor

    run_monitor(settings)


@app.command("keygen")
def keygen(
    owner: bool = typer.Option(False, "--owner", help="Make a swarm owner's key pair (for private swarms) instead of a peer identity."),
    out: Path = typer.Option(Path("owner"), "--out", help="With --owner: write OUT.key (keep it secret) and OUT.pub (give it to every peer)."),
    identity_path: Optional[Path] = typer.Option(None, "--identity-path", help="Peer identity file to create (if missing) and show the peer ID of."),
) -> None:
    """Make keys: a peer identity (its peer ID is what an owner admits) or a private swarm's owner key.

    [bold]Examples[/bold]

      phalanx keygen --identity-path me.id

      phalanx keygen --owner --out myswarm
    """
    from phalanx.security.admission import generate_owner_key

    if owner:
        private, public = out.with_suffix(".key"), out.with_suffix(".pub")
        generate_owner_key(private, public)
        typer.echo(f"owner key: {private} (secret)\nshare with every peer: --admission {public}")
        return
    if identity_path is None:
        raise ConfigError("keygen needs --identity-path (a peer identity) or --owner (a swarm owner key)")
    from hivemind.p2p import P2P

    from phalanx.security.identity import Identity

    if not identity_path.exists():
        P2P.generate_identity(str(identity_path))
    typer.echo(Identity.load(identity_path).peer_id)


@app.command("admit")
def admit(
    owner_key: Path = typer.Option(..., "--owner-key", help="The owner's private key (OUT.key from `phalanx keygen --owner`)."),
    peer_id: str = typer.Option(..., "--peer-id", help="The peer to admit (printed by `phalanx keygen --identity-path`)."),
    run_id: str = typer.Option("phalanx", "--run-id", help="The swarm (run id) the certificate is for."),
    valid_days: float = typer.Option(30.0, "--valid-days", min=0.001, help="How long the certificate stays valid."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to write the certificate (default: <peer-id>.cert)."),
) -> None:
    """Issue a certificate admitting one peer to a private swarm (peers started with --admission
    refuse everything from peers without one).

    [bold]Examples[/bold]

      phalanx admit --owner-key myswarm.key --peer-id 12D3KooW... --valid-days 7

      phalanx join --admission myswarm.pub --certificate 12D3KooW....cert --identity-path me.id ...
    """
    from phalanx.security.admission import issue, load_owner_private
    from phalanx.security.identity import is_peer_id

    if not is_peer_id(peer_id):
        raise ConfigError(f"--peer-id: {peer_id!r} is not a peer ID (like 12D3KooW... or Qm...)")
    path = out or Path(f"{peer_id}.cert")
    path.write_bytes(issue(load_owner_private(owner_key), peer_id, run_id, valid_days * 86400))
    typer.echo(f"certificate for {peer_id} in run {run_id!r}, valid {valid_days:g} days: {path}")


def _check_join_args(args: list[str]) -> PeerPlan:
    """Validate `phalanx join` flags as the trainers will parse them, without starting anything."""
    command = typer.main.get_command(app).get_command(None, "join")  # type: ignore[union-attr]
    with command.make_context("phalanx swarm", list(args)) as ctx:
        settings = join.settings(**ctx.params)  # type: ignore[attr-defined]
    settings.round_config(*settings.aggregator_spec())  # the round's mistakes before the plan imports torch
    from phalanx.peer.plan import make_plan

    return make_plan(settings)


def _swarm_target(training: TrainingConfig) -> tuple[Metric, Optional[float]]:
    """The task's metric and the run's target in it: the target flag that fits the task (the other one is
    a one-line error), else the task's default. The task is built once here for that, so a problem with
    it (its data, say) is one line now rather than every trainer's at start."""
    from phalanx.peer.trainer import run_target, task_options
    from phalanx.tasks import resolve_task

    task = resolve_task(training.task, **task_options(training))
    target = run_target(task, training)
    return task.metric, task.default_target if target is None else target


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: run the app and turn user mistakes (ours and click's) into one line."""
    try:  # typer vendors click since 0.2x; older ones use click itself
        from typer._click import exceptions as click_errors
    except ImportError:
        from click import exceptions as click_errors
    try:
        code = app(args=argv, prog_name="phalanx", standalone_mode=False)
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(130)
    except click_errors.NoArgsIsHelpError as e:
        e.show()
        sys.exit(e.exit_code)
    except click_errors.UsageError as e:
        if _state["debug"]:
            raise
        where = e.ctx.command_path if e.ctx is not None else "phalanx"
        message = " ".join(e.format_message().split())
        typer.secho(f"error: {message} (see `{where} --help`)", err=True, fg="red")
        sys.exit(e.exit_code)
    except click_errors.ClickException as e:
        typer.secho(f"error: {' '.join(e.format_message().split())}", err=True, fg="red")
        sys.exit(e.exit_code)
    except PhalanxError as e:
        if _state["debug"]:
            raise
        typer.secho(f"error: {e}", err=True, fg="red")
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
