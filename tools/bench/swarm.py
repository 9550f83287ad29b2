"""`phalanx bench swarm`: wall time to a target for `phalanx swarm` (sync, and lasgd),
hivemind's collaborative `hivemind.Optimizer` and torch DDP over gloo.

Same task, model (identical initial weights), batch per peer, the task's optimizer (digits-mlp: SGD
with momentum 0.9; tiny-gpt: AdamW with its warm-up and cosine schedule, which every implementation
follows by global step), evaluation every 10 steps. The target is a test accuracy (digits-mlp) or a
validation loss (tiny-gpt). The clock starts when every peer is ready to train (process and DHT
start-up excluded) and stops at the first evaluation that meets the target. Each worker reports its
peak resident memory (the trainer process, not its DHT process or p2pd).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from phalanx.errors import ConfigError
from phalanx.tasks.metric import METRICS
from phalanx.tools.bench import bench_console

EVAL_EVERY = 10
SEED = 0
IMPLS = ("phalanx", "phalanx-lasgd", "hivemind", "ddp")
# `phalanx bench diloco`: the same runs, phalanx only, by the flags each adds to `phalanx join`
DILOCO_H = 50
SMALL_GPT = "dim=64,layers=2,heads=4,context=64"  # tiny-gpt's default here: fits a shared CPU
# hivemind.Optimizer's matchmaking time: 1 s is the fastest setting that still groups 4 local peers
# reliably here (its default of 15 s, or the quickstart's 3 s, only make it slower)
HIVEMIND_MATCHMAKING_TIME_S = 1.0
HIVEMIND_AVERAGING_TIMEOUT_S = 10.0


def _task_and_model(name: str, options: str):
    from phalanx.aggregation.spec import parse_params
    from phalanx.tasks import resolve_task

    task = resolve_task(name, **parse_params(options))
    model = task.build_model(SEED)
    return task, model


def _met(metrics: dict[str, float], metric: str, target: float) -> bool:
    return METRICS[metric].reached(metrics[metric], target)


def _outer_steps(events: list[dict[str, Any]]) -> dict[int, tuple[list[float], list[float]]]:
    """Each outer step's `outer` events: when each member applied it, and its round time there."""
    by_step: dict[int, tuple[list[float], list[float]]] = {}
    for e in events:
        if e["event"] == "outer" and e.get("round_s") is not None:
            ends, rounds = by_step.setdefault(e["outer_step"], ([], []))
            ends.append(e["t"])
            rounds.append(e["round_s"])
    return by_step


def rounds_cost_s(events: list[dict[str, Any]]) -> Optional[float]:
    """Seconds a diloco run spent in its rounds rather than training: for each outer step the round time of
    the member that reached it last (the least of the members' times, since the others waited for it in
    matchmaking), summed. Far steadier than wall time on a shared machine: it leaves out the training."""
    by_step = _outer_steps(events)
    return sum(min(rounds) for _, rounds in by_step.values()) if by_step else None


def phase_times_s(events: list[dict[str, Any]], started: float) -> Optional[list[float]]:
    """A diloco run's training between its rounds: for each outer step, from the one before (the first:
    `started`) to the first member's applying it, less its round (rounds_cost_s's). Where a cost beyond
    the rounds sits: in the first phase (start-up), or in every phase."""
    phases, before = [], started
    for _, (ends, rounds) in sorted(_outer_steps(events).items()):
        phases.append(min(ends) - before - min(rounds))
        before = min(ends)
    return phases or None


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- reference workers (one process each; they print TARGET/DONE lines) -----------------------


def _wait_for_go() -> float:
    print("READY", flush=True)
    line = sys.stdin.readline()
    if not line.startswith("GO"):
        raise SystemExit("coordinator went away")
    return time.time()


def _run_ddp(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world)
    task, model = _task_and_model(args.task, args.task_options)
    ddp = DistributedDataParallel(model)
    opt = task.make_optimizer(ddp.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, task.lr_factor)
    _wait_for_go()
    dist.barrier()
    flag = torch.zeros(1)
    for step in range(1, args.max_steps + 1):
        inputs, targets = task.batch(SEED, f"rank{args.rank}", step, task.batch_size)
        opt.zero_grad()
        task.loss(ddp, inputs, targets).backward()
        opt.step()
        schedule.step()
        if step % EVAL_EVERY == 0:
            if args.rank == 0 and _met(task.evaluate(model), args.metric, args.target):
                flag.fill_(1.0)
                print(f"TARGET {time.time()} {step}", flush=True)
            dist.broadcast(flag, src=0)
            if flag.item():
                break
    print(f"DONE failures=0 steps={step} rss={_peak_rss()}", flush=True)
    dist.destroy_process_group()


def _run_hivemind(args) -> None:
    import hivemind

    task, model = _task_and_model(args.task, args.task_options)
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True)
    opt = hivemind.Optimizer(
        dht=dht,
        run_id="phalanx_bench_swarm",
        batch_size_per_step=task.batch_size,
        target_batch_size=task.batch_size * args.world,
        optimizer=lambda params: task.make_optimizer(params),
        params=model.parameters(),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, task.lr_factor),  # stepped per epoch
        matchmaking_time=HIVEMIND_MATCHMAKING_TIME_S,
        averaging_timeout=HIVEMIND_AVERAGING_TIMEOUT_S,
        verbose=False,
    )
    _wait_for_go()
    deadline = time.time() + args.time_limit_s
    step = 0
    try:
        while step < args.max_steps and time.time() < deadline:
            step += 1
            inputs, targets = task.batch(SEED, f"rank{args.rank}", step, task.batch_size)
            opt.zero_grad()
            task.loss(model, inputs, targets).backward()
            opt.step()
            if args.rank == 0 and step % EVAL_EVERY == 0 and _met(task.evaluate(model), args.metric, args.target):
                print(f"TARGET {time.time()} {opt.local_epoch}", flush=True)
                break
    finally:
        print(f"DONE failures=0 steps={step} rss={_peak_rss()}", flush=True)  # failures are counted from its log
        opt.shutdown()
        dht.shutdown()


def worker_main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("impl", choices=("hivemind", "ddp"))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--target", type=float, required=True)
    parser.add_argument("--metric", choices=("accuracy", "loss"), default="accuracy")
    parser.add_argument("--task", default="digits-mlp")
    parser.add_argument("--task-options", default="")
    parser.add_argument("--max-steps", type=int, default=5000)
    parser.add_argument("--time-limit-s", type=float, default=600)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    {"hivemind": _run_hivemind, "ddp": _run_ddp}[args.impl](args)


# ---- the coordinator -----------------------------------------------------------------------------


def _run_reference(impl: str, world: int, goal: Goal, time_limit_s: float) -> dict[str, Any]:
    from phalanx.tools.bench.allreduce import _free_port

    bootstrap = None
    initial: list[str] = []
    if impl == "hivemind":
        import hivemind

        bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True)
        initial = [str(m) for m in bootstrap.get_visible_maddrs()]
    port = _free_port()
    procs = []
    try:
        for rank in range(world):
            cmd = [
                sys.executable, "-m", "phalanx.tools.bench.swarm", impl, "--rank", str(rank), "--world", str(world),
                "--port", str(port), "--target", str(goal.target), "--time-limit-s", str(time_limit_s),
                "--metric", goal.metric, "--task", goal.task, "--task-options", goal.task_options,
            ]  # fmt: skip
            if initial:
                cmd += ["--initial-peers", *initial]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )  # fmt: skip
            )
        for rank, p in enumerate(procs):
            if p.stdout.readline().strip() != "READY":
                from phalanx.errors import PhalanxError
                from phalanx.tools.launcher.report import error_line

                p.kill()
                why = error_line(p.communicate()[1]) or "nothing on its stderr"
                raise PhalanxError(f"{impl} worker {rank} exited before it was ready (code {p.returncode}): {why}")
        started = time.time()
        for p in procs:
            p.stdin.write("GO\n")
            p.stdin.flush()
        reached, failures, steps, rss = None, 0, 0, []
        for p in procs:
            out, err = p.communicate(timeout=time_limit_s + 120)
            # hivemind logs failed matchmaking / averaging from its own processes to stderr
            failures += sum(_is_failure(line) for line in err.splitlines())
            for line in out.splitlines():
                if line.startswith("TARGET "):
                    reached = float(line.split()[1]) - started
                    steps = int(line.split()[2])
                elif line.startswith("DONE "):
                    failures += int(line.split("failures=")[1].split()[0])
                    rss.append(int(line.split("rss=")[1].split()[0]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if bootstrap is not None:
            bootstrap.shutdown()
    return {"impl": impl, "time_s": reached, "steps": steps, "failures": failures, "peak_rss": max(rss, default=None)}


def _is_failure(line: str) -> bool:
    """One line per failed hivemind averaging step (its own log message)."""
    return "Averaging step failed" in line and "] " in line


def _run_phalanx(world: int, goal: Goal, extra_args: list[str]) -> dict[str, Any]:
    import uvloop

    from phalanx.tools.launcher.swarm import Swarm

    args = [
        "--task", goal.task, "--steps", "5000", f"--target-{goal.metric}", str(goal.target), "--eval-every", str(EVAL_EVERY),
        "--wait-for-peers", str(world), "--seed", str(SEED), *extra_args,
    ]  # fmt: skip
    if goal.task_options:
        args += ["--task-options", goal.task_options]
    swarm = Swarm(world, args, target=goal.target, metric=METRICS[goal.metric], live=False)
    result = uvloop.run(swarm.run())
    if result.kept_workdir is not None:
        swarm.console.print(
            f"phalanx did not reach the target; its logs are kept in {result.kept_workdir}", soft_wrap=True
        )
    events = [e for v in result.peers for e in v.events]
    starts = [e["t"] for e in events if e["event"] == "training"]
    hits = [e for e in events if e["event"] == "eval" and _met(e, goal.metric, goal.target)]
    rounds = [(v.report or {}).get("rounds", {}) for v in result.peers]  # each trainer's RoundCounts
    reports = [v.report or {} for v in result.peers]
    failures = sum(r.get("failed", 0) + r.get("partial", 0) for r in rounds)
    return {
        "impl": "phalanx",
        "time_s": (min(h["t"] for h in hits) - min(starts)) if hits and starts else None,
        "phases_s": phase_times_s(events, min(starts)) if starts else None,
        "steps": min(h["step"] for h in hits) if hits else 0,
        "failures": failures,
        "resyncs": sum(r.get("resyncs", 0) for r in rounds),
        "peak_rss": max((r["peak_rss_bytes"] for r in reports if r.get("peak_rss_bytes")), default=None),
        "bytes_sent": max((r.get("bytes_sent", 0) for r in reports), default=0),
        "rounds": max((r.get("ok", 0) + r.get("partial", 0) for r in rounds), default=0),
        "rounds_s": rounds_cost_s(events),
    }


@dataclass(frozen=True)
class Goal:
    task: str
    task_options: str
    metric: str  # the key of the task's Metric: "accuracy" (at least target) or "loss" (at most target)
    target: float

    @classmethod
    def for_task(cls, command: str, task: str, options: str, target_accuracy: float, target_loss: float) -> Goal:
        """digits-mlp's goal is a test accuracy, tiny-gpt's a validation loss (on a small config by default)."""
        if task == "tiny-gpt":
            return cls(task, options or SMALL_GPT, "loss", target_loss)
        if task == "digits-mlp":
            return cls(task, options, "accuracy", target_accuracy)
        raise ConfigError(f"--task {task}: bench {command} runs digits-mlp or tiny-gpt")

    def __str__(self) -> str:
        metric = METRICS[self.metric]
        return f"{metric.label} {'≥' if metric.higher_is_better else '≤'} {self.target} on {self.task}"


def run_swarm_bench(
    peers: int, goal: Goal, impls: list[str], *, repeats: int = 1, time_limit_s: float = 300, console=None
) -> list[dict[str, Any]]:
    from rich.table import Table

    console = console or bench_console()
    rows = []
    for impl in impls:
        runs = []
        for i in range(repeats):
            console.print(f"running {impl} with {peers} peers to {goal} (run {i + 1}/{repeats})…")
            if impl.startswith("phalanx"):
                run = _run_phalanx(peers, goal, ["--mode", "lasgd"] if impl == "phalanx-lasgd" else [])
            else:
                run = _run_reference(impl, peers, goal, time_limit_s)
            runs.append(run)
        times = [r["time_s"] for r in runs if r["time_s"] is not None]
        rows.append(
            {
                "impl": impl,
                "time_s": statistics.median(times) if len(times) == len(runs) else None,
                "steps": statistics.median(r["steps"] for r in runs),
                "failures": sum(r["failures"] for r in runs),
                "peak_rss": max((r["peak_rss"] for r in runs if r.get("peak_rss")), default=None),
                "runs": runs,
            }
        )
    table = Table(title=f"time to {goal}, {peers} peers (median of {repeats})")
    for col in ("impl", "seconds", "steps", "failed rounds", "vs phalanx", "peak RSS MB/peer"):
        table.add_column(col, justify="right")
    ours = next((r for r in rows if r["impl"] == "phalanx"), None)
    for r in rows:
        ratio = ""
        if ours and ours["time_s"] and r["time_s"]:
            ratio = f"{r['time_s'] / ours['time_s']:.2f}×"
        table.add_row(
            r["impl"],
            "not reached" if r["time_s"] is None else f"{r['time_s']:.2f}",
            f"{r['steps']:.0f}",
            str(r["failures"]),
            ratio,
            "" if r["peak_rss"] is None else f"{r['peak_rss'] / 1e6:.0f}",
        )
    console.print(table)
    hm = next((r for r in rows if r["impl"] == "hivemind"), None)
    if ours and hm and ours["time_s"] and hm["time_s"]:
        share = ours["time_s"] / hm["time_s"]
        ok = share <= 1 / 3 and ours["failures"] == 0
        console.print(
            f"goal: phalanx ≤ 1/3 of hivemind's time with no failed round — {share:.3f} of it,"
            f" {ours['failures']} failed/partial rounds: {'met' if ok else 'NOT met'}"
        )
    return rows



def run_diloco_bench(
    peers: int, goal: Goal, cases: list[tuple[str, list[str]]], *, upload_mbps: float, repeats: int = 1, console=None
) -> list[dict[str, Any]]:
    """Phalanx runs that differ by their join flags (sync, diloco, diloco + int8, ...), each to `goal`
    under an upload cap per peer; wall time, bytes sent per peer and rounds, with ratios to the first."""
    from rich.table import Table

    console = console or bench_console()
    cap = ["--upload-limit-mbps", str(upload_mbps)] if upload_mbps else []
    # repeats interleave the cases, so a shared machine's load as it drifts weighs on every case alike
    by_case: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in cases}
    for i in range(repeats):
        for label, flags in cases:
            console.print(
                f"running {label} with {peers} peers to {goal}, upload {upload_mbps or 'uncapped'} Mbit/s (run {i + 1}/{repeats})…"
            )
            by_case[label].append(_run_phalanx(peers, goal, [*flags, *cap]))
    rows = [summarize_case(label, runs) for label, runs in by_case.items()]
    cap_text = f"{upload_mbps:g} Mbit/s upload per peer" if upload_mbps else "uncapped loopback"
    table = Table(title=f"to {goal}, {peers} peers, {cap_text} (median of {repeats})")
    for col in ("run", "seconds", "runs' range", "steps", "rounds", "s in rounds", "MB sent/peer", "fewer bytes", "vs first"):
        table.add_column(col, justify="right")
    first = rows[0]
    for r in rows:
        fewer = first["bytes_sent"] / r["bytes_sent"] if r["bytes_sent"] else None
        fewer = "" if fewer is None else f"{fewer:.0f}×" if fewer >= 10 else f"{fewer:.2f}×"
        ratio = f"{r['time_s'] / first['time_s']:.2f}×" if r["time_s"] and first["time_s"] else ""
        spread = "" if r["spread"] is None else f"{r['spread'][0]:.1f}–{r['spread'][1]:.1f}"
        table.add_row(
            r["impl"], "not reached" if r["time_s"] is None else f"{r['time_s']:.1f}", spread, f"{r['steps']:.0f}",
            f"{r['rounds']:.0f}", "" if r["rounds_s"] is None else f"{r['rounds_s']:.2f}", f"{r['bytes_sent'] / 1e6:.2f}",
            fewer, ratio,
        )  # fmt: skip
    console.print(table)
    return rows


def summarize_case(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A case's row: medians over its runs; a time only if every run reached the target."""
    times = [r["time_s"] for r in runs if r["time_s"] is not None]
    in_rounds = [r["rounds_s"] for r in runs if r.get("rounds_s") is not None]
    every = len(times) == len(runs)
    return {
        "impl": label,
        "time_s": statistics.median(times) if every else None,
        "spread": (min(times), max(times)) if every else None,
        "times": [r["time_s"] for r in runs],  # in run order: the cases' i-th runs ran side by side in time
        "rounds_s": statistics.median(in_rounds) if in_rounds and len(in_rounds) == len(runs) else None,
        "phases_s": _phase_medians([r.get("phases_s") for r in runs]),
        "steps": statistics.median(r["steps"] for r in runs),
        "bytes_sent": statistics.median(r["bytes_sent"] for r in runs),
        "rounds": statistics.median(r["rounds"] for r in runs),
        "failures": sum(r["failures"] for r in runs),
    }


def _phase_medians(runs: list[Optional[list[float]]]) -> Optional[list[float]]:
    """Each phase's median over the runs, if every run had the same number of phases."""
    if not runs or any(p is None or len(p) != len(runs[0]) for p in runs):
        return None
    return [statistics.median(times) for times in zip(*runs)]


def paired_ratio(reference: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """`case`'s median wall time over `reference`'s, with the range of the paired runs' ratios (each run
    against the reference's run beside it in time) and, from 5 pairs, a 90% bootstrap interval of the
    ratio of medians resampled over the pairs."""
    paired = [(r, c) for r, c in zip(reference["times"], case["times"], strict=True) if r and c]
    pairs = [c / r for r, c in paired]
    found: dict[str, Any] = {
        "ratio": case["time_s"] / reference["time_s"],
        "pairs": (min(pairs), statistics.median(pairs), max(pairs)) if pairs else None,
        "interval": None,
    }
    if len(paired) >= 5:  # fewer pairs give no interval worth printing
        from scipy.stats import bootstrap

        def ratio(r, c):
            return statistics.median(c) / statistics.median(r)

        result = bootstrap(
            tuple(zip(*paired)), ratio, paired=True, vectorized=False, confidence_level=0.9, n_resamples=2000,
            method="percentile", rng=0,
        )  # fmt: skip
        found["interval"] = (float(result.confidence_interval.low), float(result.confidence_interval.high))
    return found


def verification_cost(unverified: dict[str, Any], verified: dict[str, Any]) -> dict[str, Any]:
    """What `--verify` costs, two ways: the paired ratio of wall times, and the extra seconds its rounds
    took as a share of the unverified wall time (steady: training time is left out)."""
    cost = {**paired_ratio(unverified, verified), "rounds_share": None}
    if unverified["rounds_s"] is not None and verified["rounds_s"] is not None:
        cost["rounds_share"] = (verified["rounds_s"] - unverified["rounds_s"]) / unverified["time_s"]
    return cost


def ratio_verdict(found: dict[str, Any], bound: float, *, strict: bool = False) -> str:
    """Whether a ratio is at most `bound` (`strict`: below it): at the median, and across its interval."""
    ratio, interval = found["ratio"], found["interval"]
    if ratio > bound or (strict and ratio >= bound):
        return "NOT met"
    if interval is not None and (interval[1] > bound or (strict and interval[1] >= bound)):
        return f"met at the median, not beyond doubt (its 90% interval reaches {interval[1]:.2f}×: run more --repeats)"
    return "met"


def _print_spread(found: dict[str, Any], runs: int, console) -> None:
    if found["interval"] is not None:
        low, high = found["interval"]
        console.print(f"  90% interval of that ratio: {low:.2f}–{high:.2f}× (bootstrap over the paired runs)")
    if found["pairs"] is not None and runs > 1:
        low, mid, high = found["pairs"]
        console.print(f"  paired runs' ratios: median {mid:.2f}×, {low:.2f}–{high:.2f}×")


def print_diloco_goals(
    sync: Optional[dict], int8: Optional[dict], verified: Optional[dict], upload_mbps: float, console=None
) -> None:
    """The goals: diloco + int8 sends ≥ 100× fewer bytes than sync to the target, in less wall time;
    verifying it costs ≤ 1.10× its wall time under an upload cap, ≤ 1.3× on raw loopback. A goal whose
    cases did not run (--cases) or did not reach the target is said to be not measured."""
    console = console or bench_console()
    if int8 is None or not (int8["time_s"] and int8["bytes_sent"]):
        console.print("goals: not measured (the int8 case did not run or did not reach the target)")
        return
    if sync is None or not sync["time_s"]:
        console.print("goal against sync: not measured (the sync case did not run or did not reach the target)")
    else:
        fewer = sync["bytes_sent"] / int8["bytes_sent"]
        found = paired_ratio(sync, int8)
        verdict = "NOT met" if fewer < 100 else ratio_verdict(found, 1.0, strict=True)
        console.print(
            f"goal: diloco + int8 sends ≥ 100× fewer bytes than sync, in less time — {fewer:.0f}× fewer, "
            f"{found['ratio']:.2f}× the time: {verdict}"
        )
        _print_spread(found, len(int8["times"]), console)
    if verified is None or not verified["time_s"]:
        console.print("goal for verified rounds: not measured (the verify case did not run or did not reach the target)")
    else:
        bound = 1.10 if upload_mbps else 1.3
        cost = verification_cost(int8, verified)
        console.print(f"goal: verified ≤ {bound}× the unverified wall time — {cost['ratio']:.2f}×: {ratio_verdict(cost, bound)}")
        _print_spread(cost, len(int8["times"]), console)
        if cost["rounds_share"] is not None:
            console.print(
                f"  its rounds took {verified['rounds_s']:.2f} s against {int8['rounds_s']:.2f} s: "
                f"{cost['rounds_share']:+.1%} of the unverified wall time, the part of the ratio that is verification's own"
            )
        if verified["phases_s"] is not None and int8["phases_s"] is not None:
            console.print(
                f"  training between rounds, phase by phase: {_phases_text(verified['phases_s'])} s against"
                f" {_phases_text(int8['phases_s'])} s (the first from the first peer's start)"
            )


def _phases_text(phases: list[float]) -> str:
    return " / ".join(f"{p:.2f}" for p in phases)


if __name__ == "__main__":
    worker_main()
