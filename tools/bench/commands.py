"""`phalanx bench …`: each benchmark measures its reference in the same run and prints ratios.
Only typer loads here; a benchmark's own module loads when its command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from phalanx.errors import ConfigError
from phalanx.peer.flags import float_list, int_list, str_list

bench_app = typer.Typer(
    help="Benchmarks: each measures its reference in the same run and prints ratios.",
    no_args_is_help=True,
)


# `phalanx bench diloco --cases`: sync, diloco, with overlap, + int8, + verify, + verify without replays
DILOCO_CASES = ("sync", "diloco", "overlap", "int8", "verify", "verify-no-validators")
# their outer step: the best of `bench inner-state` sweeps for runs of three or four outer steps, too few for
# Nesterov momentum to pay off (a join's defaults, 0.7 and 0.9, are the paper's, for long runs)
BENCH_OUTER_LR, BENCH_OUTER_MOMENTUM = 0.9, 0.4


def _check_outer_lr(outer_lr: float) -> None:
    if not 0 < outer_lr <= 10:
        raise ConfigError(f"--outer-lr {outer_lr:g}: use a value above 0 and at most 10")


def _check_lr(lr: Optional[float]) -> None:
    if lr is not None and lr <= 0:
        raise ConfigError(f"--lr {lr:g}: use a learning rate above 0")


@bench_app.command("aggregate")
def bench_aggregate(
    n: str = typer.Option("8,16,32", "--n", help="Comma-separated numbers of rows (peers)."),
    d: str = typer.Option("1000000,10000000", "--d", help="Comma-separated vector sizes."),
    aggregators: str = typer.Option("all", "--aggregators", help="Comma-separated registry names, or 'all'."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto (every available device)."),
    repeats: int = typer.Option(5, "--repeats", min=1, help="Timed repetitions per cell (median reported)."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Time every aggregator against one read of its (n, d) input (x.sum(0), the memory-bandwidth floor).

    [bold]Examples[/bold]

      phalanx bench aggregate

      phalanx bench aggregate --n 8 --d 1000000 --aggregators mean,centered_clip --repeats 3
    """
    from phalanx.tools.bench.aggregate import run_aggregate_bench

    run_aggregate_bench(
        ns=int_list(n, "--n"),
        ds=int_list(d, "--d"),
        names=None if aggregators == "all" else str_list(aggregators),
        device=device,
        repeats=repeats,
        seed=seed,
    )


@bench_app.command("allreduce")
def bench_allreduce(
    peers: str = typer.Option("2,4", "--peers", help="Comma-separated group sizes."),
    numel: int = typer.Option(10_000_000, "--numel", min=1, help="float32 values per peer."),
    rounds: int = typer.Option(5, "--rounds", min=1, help="Timed rounds after one warm-up (median reported)."),
    impls: str = typer.Option("phalanx,hivemind,gloo", "--impls", help="Which of phalanx, hivemind, gloo to run."),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Instead: plain mean vs CenteredClip vs CenteredClip with full verification (time and bytes per round).",
    ),
    upload_mbps: str = typer.Option(
        "0",
        "--upload-mbps",
        help="With --verify: comma-separated per-peer upload caps in Mbit/s to repeat the comparison at (0: uncapped loopback).",
    ),
) -> None:
    """All-reduce one vector per peer on loopback: Phalanx's round engine (mean), hivemind's
    DecentralizedAverager and torch.distributed gloo, each in N worker processes; prints medians and ratios.

    [bold]Examples[/bold]

      phalanx bench allreduce --peers 2,4 --numel 10000000

      phalanx bench allreduce --peers 4 --numel 1000000 --impls phalanx,gloo

      phalanx bench allreduce --verify --peers 4 --numel 10000000

      phalanx bench allreduce --verify --peers 4 --upload-mbps 0,1000,100
    """
    from phalanx.tools.bench.allreduce import IMPLS, run_allreduce_bench, run_verify_bench

    limits = float_list(upload_mbps, "--upload-mbps")
    if any(x < 0 for x in limits):
        raise ConfigError("--upload-mbps: caps must be ≥ 0 (0: uncapped)")
    if verify:
        run_verify_bench(int_list(peers, "--peers"), numel, rounds, tuple(limits))
        return
    if any(limits):
        raise ConfigError("--upload-mbps applies to --verify only (hivemind and gloo cannot be capped the same way)")
    chosen = str_list(impls)
    unknown = sorted(set(chosen) - set(IMPLS))
    if unknown:
        raise ConfigError(f"--impls: unknown {', '.join(unknown)}; choose from {', '.join(IMPLS)}")
    run_allreduce_bench(int_list(peers, "--peers"), numel, rounds, chosen)


@bench_app.command("swarm")
def bench_swarm(
    peers: int = typer.Option(4, "--peers", min=1, help="Peers (processes) per run."),
    task: str = typer.Option(
        "digits-mlp", "--task", help="digits-mlp (target: test accuracy) or tiny-gpt (target: validation loss)."
    ),
    task_options: str = typer.Option(
        "", "--task-options", help="The task's options, name=value,... (tiny-gpt default: a small CPU config)."
    ),
    target_accuracy: float = typer.Option(0.95, "--target-accuracy", min=0.0, max=1.0, help="digits-mlp's target."),
    target_loss: float = typer.Option(3.0, "--target-loss", min=0.0, help="tiny-gpt's target."),
    impls: str = typer.Option(
        "phalanx,hivemind,ddp", "--impls", help="Which of phalanx, phalanx-lasgd, hivemind, ddp to run."
    ),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Runs per implementation (median reported)."),
    time_limit_s: float = typer.Option(300.0, "--time-limit-s", help="Give up on a reference run after this long."),
) -> None:
    """Wall time to a target: `phalanx swarm` (sync, or lasgd), hivemind's collaborative
    hivemind.Optimizer and torch DDP over gloo, same model, data, optimizer and schedule.

    [bold]Examples[/bold]

      phalanx bench swarm --peers 4

      phalanx bench swarm --peers 2 --impls phalanx,ddp --repeats 3

      phalanx bench swarm --task tiny-gpt --peers 4 \\
          --impls phalanx,phalanx-lasgd,hivemind,ddp
    """
    from phalanx.tools.bench.swarm import IMPLS, Goal, run_swarm_bench

    chosen = str_list(impls)
    unknown = sorted(set(chosen) - set(IMPLS))
    if unknown:
        raise ConfigError(f"--impls: unknown {', '.join(unknown)}; choose from {', '.join(IMPLS)}")
    goal = Goal.for_task("swarm", task, task_options, target_accuracy, target_loss)
    run_swarm_bench(peers, goal, chosen, repeats=repeats, time_limit_s=time_limit_s)


@bench_app.command("diloco")
def bench_diloco(
    peers: int = typer.Option(4, "--peers", min=1, help="Peers (processes) per run."),
    task: str = typer.Option(
        "digits-mlp", "--task", help="digits-mlp (target: test accuracy) or tiny-gpt (target: validation loss)."
    ),
    task_options: str = typer.Option(
        "", "--task-options", help="The task's options, name=value,... (tiny-gpt default: a small CPU config)."
    ),
    target_accuracy: float = typer.Option(0.95, "--target-accuracy", min=0.0, max=1.0, help="digits-mlp's target."),
    target_loss: float = typer.Option(
        2.62,
        "--target-loss",
        min=0.0,
        help="tiny-gpt's target; the default lies between outer steps 2 and 3 of H = 50 on the small config "
        "(see bench inner-state), so runs do not flip between two numbers of rounds.",
    ),
    inner_steps: int = typer.Option(50, "--inner-steps", min=1, help="DiLoCo's H."),
    outer_lr: float = typer.Option(BENCH_OUTER_LR, "--outer-lr", help="The diloco runs' outer learning rate."),
    outer_momentum: float = typer.Option(
        BENCH_OUTER_MOMENTUM, "--outer-momentum", min=0.0, max=0.99, help="The diloco runs' outer momentum."
    ),
    lr: Optional[float] = typer.Option(
        None, "--lr", help="Every case's learning rate: sync's and diloco's inner optimizer's (default: the task's)."
    ),
    upload_mbps: float = typer.Option(100.0, "--upload-mbps", min=0.0, help="Upload cap per peer (0: uncapped)."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Runs per case (median reported)."),
    cases: str = typer.Option(
        ",".join(DILOCO_CASES), "--cases", help=f"Comma-separated cases to run, in this order: {', '.join(DILOCO_CASES)}."
    ),
) -> None:
    """To the same target under an upload cap: sync, diloco without and with overlap, diloco with
    int8 pseudo-gradients, that verified, and verified without validators (the protocol's own cost,
    no replays): wall time, bytes sent per peer, rounds.

    [bold]Examples[/bold]

      phalanx bench diloco --peers 4 --upload-mbps 100

      phalanx bench diloco --task tiny-gpt --peers 4 --inner-steps 20

      phalanx bench diloco --task tiny-gpt --cases int8,verify,verify-no-validators --repeats 3
    """
    from phalanx.tools.bench.swarm import Goal, print_diloco_goals, run_diloco_bench

    _check_outer_lr(outer_lr)
    _check_lr(lr)
    chosen = str_list(cases)
    if not chosen or any(c not in DILOCO_CASES for c in chosen):
        raise ConfigError(f"--cases {cases}: choose from {', '.join(DILOCO_CASES)}")
    goal = Goal.for_task("diloco", task, task_options, target_accuracy, target_loss)
    diloco = ["--mode", "diloco", "--inner-steps", str(inner_steps), "--outer-lr", str(outer_lr),
              "--outer-momentum", str(outer_momentum)]  # fmt: skip
    int8 = [*diloco, "--compression", "int8"]
    every = {
        "sync": ("sync", ["--mode", "sync"]),
        "diloco": (f"diloco H={inner_steps}", diloco),
        "overlap": (f"diloco H={inner_steps}, overlap on", [*diloco, "--overlap", "on"]),
        "int8": (f"diloco H={inner_steps} + int8", int8),
        "verify": (f"diloco H={inner_steps} + int8 + verify", [*int8, "--verify"]),
        "verify-no-validators": (f"diloco H={inner_steps} + int8 + verify, no validators", [*int8, "--verify", "--validators", "0"]),
    }  # fmt: skip
    if lr is not None:
        every = {c: (label, [*flags, "--lr", str(lr)]) for c, (label, flags) in every.items()}
    runs = [every[c] for c in dict.fromkeys(chosen)]
    rows = {r["impl"]: r for r in run_diloco_bench(peers, goal, runs, upload_mbps=upload_mbps, repeats=repeats)}
    print_diloco_goals(*(rows.get(every[c][0]) for c in ("sync", "int8", "verify")), upload_mbps)


@bench_app.command("inner-state")
def bench_inner_state(
    peers: int = typer.Option(4, "--peers", min=2, help="Simulated peers."),
    task: str = typer.Option("tiny-gpt", "--task", help="digits-mlp (target: test accuracy) or tiny-gpt (target: validation loss)."),
    task_options: str = typer.Option(
        "", "--task-options", help="The task's options, name=value,... (tiny-gpt default: a small CPU config)."
    ),
    target_accuracy: float = typer.Option(0.95, "--target-accuracy", min=0.0, max=1.0, help="digits-mlp's target."),
    target_loss: float = typer.Option(2.62, "--target-loss", min=0.0, help="tiny-gpt's target (bench diloco's)."),
    inner_steps: int = typer.Option(50, "--inner-steps", min=1, help="DiLoCo's H."),
    outer_lr: float = typer.Option(BENCH_OUTER_LR, "--outer-lr", help="The outer learning rate (bench diloco's)."),
    outer_momentum: float = typer.Option(
        BENCH_OUTER_MOMENTUM, "--outer-momentum", min=0.0, max=0.99, help="The outer momentum (bench diloco's)."
    ),
    lr: Optional[float] = typer.Option(None, "--lr", help="The inner optimizer's learning rate (default: the task's)."),
    rounds: int = typer.Option(6, "--rounds", min=1, help="Outer steps per run."),
    seeds: int = typer.Option(5, "--seeds", min=1, help="Runs per variant, each on other batches."),
    unverified_only: bool = typer.Option(
        False, "--unverified-only", help="Only the unverified variant (a quarter of the time: for sweeps of H and the rates)."
    ),
    phase_warmup: int = typer.Option(10, "--phase-warmup", min=0, help="A verified phase's learning-rate ramp."),
    validators: int = typer.Option(1, "--validators", min=0, help="Members drawn to sit each phase out (at most a third)."),
) -> None:
    """What verified diloco's fresh inner optimizer state (and its sitting validators) cost in quality:
    the swarm's outer steps simulated in one process, unverified against verified, same seeds.

    [bold]Examples[/bold]

      phalanx bench inner-state

      phalanx bench inner-state --task digits-mlp --inner-steps 20 --rounds 8 --target-accuracy 0.9

      phalanx bench inner-state --unverified-only --inner-steps 40 --lr 0.004 --rounds 4 --seeds 2
    """
    from phalanx.tools.bench.inner_state import run_inner_state_bench
    from phalanx.tools.bench.swarm import Goal

    _check_outer_lr(outer_lr)
    _check_lr(lr)
    goal = Goal.for_task("inner-state", task, task_options, target_accuracy, target_loss)
    run_inner_state_bench(
        goal, peers=peers, inner_steps=inner_steps, rounds=rounds, seeds=seeds,
        phase_warmup=phase_warmup, validators=validators, outer_lr=outer_lr, outer_momentum=outer_momentum,
        lr=lr, unverified_only=unverified_only,
    )  # fmt: skip


@bench_app.command("replay")
def bench_replay(
    task: str = typer.Option("tiny-gpt", "--task", help="A built-in task."),
    task_options: str = typer.Option(
        "dim=64,layers=2,heads=4,context=64", "--task-options", help="The task's options, name=value,..."
    ),
    inner_steps: int = typer.Option(50, "--inner-steps", min=1, help="DiLoCo's H: the steps a validator replays."),
    threads: str = typer.Option("1,2", "--threads", help="Comma-separated torch thread counts; the first is the reference."),
    parts: int = typer.Option(8, "--parts", min=1, help="Parts of the vector (a round's members), compared one by one."),
    devices: str = typer.Option(
        "cpu", "--devices", help="Comma-separated devices, one per replay (one value: every replay); the first is the reference."
    ),
) -> None:
    """How far two honest replays of H inner steps differ (other thread counts or devices), against
    the tolerance validators of verified diloco rounds accept.

    [bold]Examples[/bold]

      phalanx bench replay

      phalanx bench replay --task digits-mlp --task-options "" --inner-steps 500 --threads 1,2

      phalanx bench replay --devices cuda,cuda,cpu --threads 1
    """
    from phalanx.tools.bench.replay import run_replay_bench

    run_replay_bench(task, task_options, inner_steps, int_list(threads, "--threads"), parts, tuple(str_list(devices)) or ("cpu",))


@bench_app.command("convergence")
def bench_convergence(
    peers: int = typer.Option(4, "--peers", min=2, help="Peers per run (one of them a straggler)."),
    target_accuracy: float = typer.Option(0.95, "--target-accuracy", min=0.0, max=1.0),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Runs per mode (median reported)."),
    base_step_s: float = typer.Option(
        0.01, "--base-step-s", min=0.0, help="Every local step takes at least this long (stands in for GPU work)."
    ),
    straggler: str = typer.Option(
        "shifted-exp:0.025:0.025",
        "--straggler",
        help="The straggler's step time (--slowdown form); the default is ~5× the others.",
    ),
    max_steps: int = typer.Option(3000, "--max-steps", min=1),
) -> None:
    """Wall time to the target accuracy on digits with one straggler: sync, lasgd with Gap-Aware,
    lasgd without correction, and gossip, each run --repeats times as a real swarm.

    [bold]Examples[/bold]

      phalanx bench convergence

      phalanx bench convergence --peers 4 --repeats 1 --straggler shifted-exp:0.05:0.05
    """
    from phalanx.peer.slowdown import parse_slowdown
    from phalanx.tools.bench.convergence import run_convergence_bench

    parse_slowdown(straggler)
    run_convergence_bench(
        peers, target_accuracy, repeats, base_step_s=base_step_s, straggler=straggler, max_steps=max_steps
    )


@bench_app.command("cli")
def bench_cli(
    repeats: int = typer.Option(5, "--repeats", min=1, help="Timed runs per command (median reported)."),
) -> None:
    """Time `phalanx --help`, `phalanx join --help` and mistyped flags (fresh processes) against
    `python -c pass` and `python -c "import torch"` measured in the same run.

    [bold]Examples[/bold]

      phalanx bench cli

      phalanx bench cli --repeats 10
    """
    from phalanx.tools.bench.cli import run_cli_bench

    run_cli_bench(repeats)


@bench_app.command("wan")
def bench_wan(
    cases: str = typer.Option(
        "mean,centered-clip,verified,diloco-int8,verified-diloco", "--cases", help="Comma-separated cases to run."
    ),
    rtt_ms: str = typer.Option(
        "0,100,300", "--rtt-ms", help="Comma-separated round-trip times between hosts, in ms (0 is always run)."
    ),
    window_s: float = typer.Option(30.0, "--window-s", min=5.0, help="Seconds measured once all train in one group."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the numbers to this file."),
) -> None:
    """Rounds at added latency (root; a lab of network namespaces): a bootstrap and 4 digits-mlp trainers per
    case and RTT; seconds per round, in RTT units, round trips beyond RTT 0, and steps/s against RTT 0.

    [bold]Examples[/bold]

      sudo phalanx bench wan

      sudo phalanx bench wan --cases mean,verified --rtt-ms 100 --window-s 20
    """
    from phalanx.tools.bench.wan import run_wan_bench

    rtts = float_list(rtt_ms, "--rtt-ms")
    if any(r < 0 or r > 2000 for r in rtts):
        raise ConfigError("--rtt-ms: use round-trip times from 0 to 2000 ms")
    run_wan_bench(str_list(cases), rtts, window_s, json_path)


@bench_app.command("far-member")
def bench_far_member(
    near_ms: float = typer.Option(25.0, "--near-ms", min=0.0, max=1000.0, help="One-way delay of every other host, ms."),
    far_ms: float = typer.Option(150.0, "--far-ms", min=0.0, max=1000.0, help="One-way delay of the far trainer's host, ms."),
    window_s: float = typer.Option(30.0, "--window-s", min=5.0, help="Seconds of rounds counted before the kills."),
    kills: int = typer.Option(3, "--kills", min=1, max=20, help="SIGKILLs of a near trainer (each restarted)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the numbers to this file."),
    logs: Optional[Path] = typer.Option(None, "--logs", help="Keep the peers' logs in this new or empty folder."),
) -> None:
    """Deadlines at mixed latency (root; a lab of network namespaces): one trainer far from the others,
    default flags. Counts the rounds that were not whole, then SIGKILLs a near trainer and measures how
    long the others stalled, against 3 s plus 3 times the far trainer's RTT.

    [bold]Examples[/bold]

      sudo phalanx bench far-member

      sudo phalanx bench far-member --near-ms 25 --far-ms 150 --kills 5
    """
    from phalanx.tools.bench.wan import run_far_member_bench

    run_far_member_bench(near_ms, far_ms, window_s, kills, json_path, logs)


@bench_app.command("state-sync")
def bench_state_sync(
    params: str = typer.Option("100M", "--params", help="float32 values in the state: a count, or with K, M or G."),
    donors: str = typer.Option("1,4", "--donors", help="Comma-separated donor counts; 1 (the reference) is always run."),
    upload_mbit: float = typer.Option(100.0, "--upload-mbit", min=1.0, help="Each donor's upload cap, in Mbit/s."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Downloads per donor count; the fastest counts."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the numbers to this file."),
) -> None:
    """A state download from one donor against disjoint chunks from several at once, on loopback, each
    donor its own process with its upload capped; every byte is checked.

    [bold]Examples[/bold]

      phalanx bench state-sync

      phalanx bench state-sync --params 20M --donors 1,2,4 --upload-mbit 50
    """
    from phalanx.tools.bench.state_sync import run_state_sync_bench

    run_state_sync_bench(_count(params, "--params"), int_list(donors, "--donors"), upload_mbit, repeats, json_path)


def _count(text: str, flag: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: use a count such as 100M, 2.5M or 500000") from None
    if not 2 <= value <= 4 * 10**9:
        raise ConfigError(f"{flag} {text!r}: use from 2 to 4G values")
    return value
