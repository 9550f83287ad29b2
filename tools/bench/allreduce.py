"""`phalanx bench allreduce`: our butterfly round vs hivemind's DecentralizedAverager vs gloo.

Each implementation runs in N worker processes on loopback with the same tensors
(numel float32 per peer), one warm-up round and then `rounds` timed rounds. A round's
time is the slowest worker's data phase (from the moment the group is formed until the
averaged tensor is back); for Phalanx we also report the whole round with matchmaking.
Every worker checks its result against the true mean, so a fast wrong answer fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

import torch

from phalanx.tools.bench import bench_console

IMPLS = ("phalanx", "hivemind", "gloo")
MAX_PARTIAL_ROUNDS = 5


SPREAD = 1e-3  # per-coordinate spread of the peers' vectors around a shared one (see below)


def _worker_tensor(rank: int, numel: int) -> torch.Tensor:
    """A shared vector plus this peer's noise: like gradients, peers differ by a fraction of the whole,
    so CenteredClip (tau=1 at ~2 units between peers for 10M values) converges in a few steps."""
    vector = torch.randn(numel, generator=torch.Generator().manual_seed(999))
    noise = torch.Generator().manual_seed(1000 + rank)
    for chunk in vector.split(1 << 20):  # in pieces: a whole second vector of noise would count as the round's memory
        chunk.add_(torch.randn(chunk.numel(), generator=noise), alpha=SPREAD)
    return vector


def _expected_mean(world: int, numel: int) -> torch.Tensor:
    total = torch.zeros(numel)
    for r in range(world):
        total += _worker_tensor(r, numel)
    return total / world


# ---- workers (one process each) ----------------------------------------------------------------


def _run_gloo(args) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world)
    base = _worker_tensor(args.rank, args.numel)
    times = []
    for r in range(args.rounds + 1):
        t = base.clone()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        t /= args.world
        if r:
            times.append(time.perf_counter() - start)
    error = (t - _expected_mean(args.world, args.numel)).abs().max().item()
    dist.destroy_process_group()
    return {"data_s": times, "round_s": times, "error": error, "bytes_sent": None}


def _run_hivemind(args) -> dict[str, Any]:
    import hivemind
    from hivemind.averaging.control import AveragingStage

    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True)
    base = _worker_tensor(args.rank, args.numel)
    tensor = base.clone()
    averager = hivemind.averaging.DecentralizedAverager(
        [tensor], dht=dht, prefix="bench", target_group_size=args.world, min_group_size=args.world,
        min_matchmaking_time=1.0, request_timeout=10.0, start=True,
    )  # fmt: skip
    data, rounds = [], []
    try:
        for r in range(args.rounds + 1):
            with averager.get_tensors() as tensors:
                tensors[0].copy_(base)
            started = time.perf_counter()
            control = averager.step(require_trigger=True, wait=False, timeout=120)
            while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                time.sleep(0.001)
            formed = time.perf_counter()
            control.allow_allreduce()
            if control.result(timeout=300) is None:
                raise RuntimeError("hivemind averaging round failed")
            end = time.perf_counter()
            if r:
                data.append(end - formed)
                rounds.append(end - started)
        with averager.get_tensors() as tensors:
            error = (tensors[0] - _expected_mean(args.world, args.numel)).abs().max().item()
    finally:
        averager.shutdown()
        dht.shutdown()
    return {"data_s": data, "round_s": rounds, "error": error, "bytes_sent": None}


def _run_phalanx(args) -> dict[str, Any]:
    import uvloop

    from phalanx.peer.config import PeerConfig
    from phalanx.peer.dht_keys import BENCH_RANK_TTL_S, BenchRank
    from phalanx.peer.node import open_node
    from phalanx.peer.plan import make_plan
    from phalanx.protocol.dht_calls import dht_get, dht_store
    from phalanx.protocol.dht_records import read_signed
    from phalanx.protocol.engine import Averaged, RoundRequest, Verification
    from phalanx.security.records import sign_record

    config = PeerConfig(
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        run_id="bench",
        aggregator=args.aggregator,
        aggregator_params=args.aggregator_params,
        min_group_size=args.world,
        matchmaking_timeout_s=60.0,
        allreduce_timeout_s=120.0,
        direct=not args.no_direct,
        verify=args.verify,
        phase_timeout_s=60.0,
        upload_limit_mbps=args.upload_mbps,
    )

    async def main() -> dict[str, Any]:
        from hivemind.utils import get_dht_time

        node = await open_node(make_plan(config))
        ranks_key = node.keys["bench"].name
        engine = node.engine
        engine.set_state(b"bench", 0)
        base = _worker_tensor(args.rank, args.numel)
        data, rounds = [], []
        ranks: dict[str, int] = {}

        async def recompute(peer: str) -> torch.Tensor:
            """A validator's recomputation: in training one gradient, here the target's seeded vector,
            made when asked as a gradient would be, so the round's memory is what a trainer's would be."""
            return _worker_tensor(ranks[peer], args.numel)

        request = RoundRequest(base, verification=Verification(recompute=recompute if args.verify else None))
        try:
            mine, expiration = sign_record(
                node.identity, ranks_key, BenchRank(rank=args.rank), signed_at=get_dht_time(), ttl_s=BENCH_RANK_TTL_S
            )
            await dht_store(node.dht, ranks_key, mine, expiration, subkey=node.peer_id)
            while len(node.membership.peers()) < args.world or len(ranks) < args.world:
                await node.membership.refresh()
                found = await dht_get(node.dht, ranks_key)
                records, _ = read_signed(found, BenchRank, key=ranks_key, max_ttl_s=BENCH_RANK_TTL_S, now=get_dht_time())
                ranks = {peer: record.rank for peer, (record, _) in records.items()}
            sent0, cpu0, measuring = 0, 0.0, False
            r, partial = 0, 0
            while r <= args.rounds:
                if r == 1 and not measuring:  # the warm-up round's last replies are sent by now: count none of them
                    await node.transport.wait_idle(30.0)
                    sent0, cpu0, measuring = node.snapshot().bytes_sent, time.process_time(), True
                outcome = None  # a trainer has applied and dropped the last round's result by now
                started = time.perf_counter()
                outcome = await engine.run_round(request)
                if not isinstance(outcome, Averaged):
                    raise RuntimeError(f"round {r}: {outcome}")
                if len(outcome.group.members) != args.world:
                    # a leader whose view of the DHT lapsed for a moment closes a smaller group: the state
                    # stays as it was and the round is repeated (its time is not counted; its bytes are)
                    partial += 1
                    if partial > MAX_PARTIAL_ROUNDS:
                        raise RuntimeError(f"round {r} formed groups of fewer than {args.world} {partial} times: {outcome.group}")
                    print(f"round {r}: a group of {len(outcome.group.members)}, repeated", file=sys.stderr, flush=True)
                    continue
                await engine.completed(outcome, dict)
                if r:
                    data.append(outcome.result.duration_s)
                    rounds.append(time.perf_counter() - started)
                r += 1
            await node.transport.wait_idle(30.0)  # and every reply of the last round is counted
            peak = _peak_rss()  # the rounds' high-water mark, before the check below allocates its own vectors
            per_round = (node.snapshot().bytes_sent - sent0) / args.rounds
            cpu = (time.process_time() - cpu0) / args.rounds  # this process only (not its p2pd daemon)
            error = float("nan")
            if args.aggregator == "mean":
                error = (outcome.result.vector - _expected_mean(args.world, args.numel)).abs().max().item()
            if args.verify and outcome.verdict.banned:
                raise RuntimeError(f"an honest benchmark round banned {outcome.verdict.banned}")
            return {"data_s": data, "round_s": rounds, "error": error, "bytes_sent": per_round, "cpu_s": cpu, "rss_peak": peak}
        finally:
            await node.aclose()

    return uvloop.run(main())


def worker_main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("impl", choices=IMPLS)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--aggregator", default="mean")
    parser.add_argument("--aggregator-params", default="")
    parser.add_argument("--no-direct", action="store_true")
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--upload-mbps", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start_rss = _resident_bytes()  # the interpreter, torch and hivemind, before any vector exists
    result = {"phalanx": _run_phalanx, "hivemind": _run_hivemind, "gloo": _run_gloo}[args.impl](args)
    result["rss_start"] = start_rss
    result.setdefault("rss_peak", _peak_rss())
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- the coordinator -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(impl: str, world: int, numel: int, rounds: int, *, extra: Optional[list[str]] = None, timeout_s: float = 900) -> dict[str, Any]:
    """Run one implementation with `world` worker processes; returns medians over rounds."""
    bootstrap = None
    initial: list[str] = []
    if impl in ("phalanx", "hivemind"):
        import hivemind

        bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True)
        initial = [str(m) for m in bootstrap.get_visible_maddrs()]
    port = _free_port()
    procs = []
    try:
        for rank in range(world):
            cmd = [
                sys.executable, "-m", "phalanx.tools.bench.allreduce", impl, "--rank", str(rank), "--world", str(world),
                "--numel", str(numel), "--rounds", str(rounds), "--port", str(port), *(extra or []),
            ]  # fmt: skip
            if initial:
                cmd += ["--initial-peers", *initial]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            )
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"{impl} worker failed (exit {p.returncode}):\n{err[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.wait()
        if bootstrap is not None:
            bootstrap.shutdown()
    data = [max(r["data_s"][i] for r in results) for i in range(rounds)]  # the slowest worker finishes the round
    total = [max(r["round_s"][i] for r in results) for i in range(rounds)]
    sent = [r["bytes_sent"] for r in results if r["bytes_sent"] is not None]
    cpu = [r["cpu_s"] for r in results if r.get("cpu_s") is not None]
    return {
        "impl": impl if not extra else f"{impl} {' '.join(extra)}",
        "peers": world,
        "numel": numel,
        "data_s": statistics.median(data),
        "round_s": statistics.median(total),
        "max_error": max(r["error"] for r in results),
        "bytes_sent_per_peer": statistics.mean(sent) if sent else None,
        "cpu_s_per_peer": statistics.mean(cpu) if cpu else None,
        # peak resident memory of the worker (this process, not its DHT process or p2pd), and what the
        # round added to it, in copies of the vector
        "peak_rss_per_peer": max(r["rss_peak"] for r in results),
        "vector_copies": max((r["rss_peak"] - r["rss_start"]) / (4 * numel) for r in results),
    }


def run_allreduce_bench(peers: list[int], numel: int, rounds: int, impls: list[str], console=None) -> list[dict[str, Any]]:
    from rich.table import Table

    console = console or bench_console()
    rows = []
    for world in peers:
        for impl in impls:
            console.print(f"running {impl} with {world} peers × {numel:,} float32 ({rounds} timed rounds)…")
            rows.append(run_case(impl, world, numel, rounds))
    table = Table(title=f"all-reduce of {numel:,} float32 per peer on loopback (median of {rounds} rounds)")
    for col in ("peers", "impl", "data phase s", "round s", "vs hivemind", "vs gloo", "MB sent/peer", "max error", "peak RSS MB", "× vector"):
        table.add_column(col, justify="right")
    for world in peers:
        ref = {r["impl"]: r for r in rows if r["peers"] == world}
        for r in (x for x in rows if x["peers"] == world):
            hm, gl = ref.get("hivemind"), ref.get("gloo")
            table.add_row(
                str(world),
                r["impl"],
                f"{r['data_s']:.3f}",
                f"{r['round_s']:.3f}",
                f"{hm['data_s'] / r['data_s']:.2f}× faster" if hm else "",
                f"{r['data_s'] / gl['data_s']:.1f}× slower" if gl else "",
                "" if r["bytes_sent_per_peer"] is None else f"{r['bytes_sent_per_peer'] / 1e6:.1f}",
                f"{r['max_error']:.1e}",
                f"{r['peak_rss_per_peer'] / 1e6:.0f}",
                f"{r['vector_copies']:.2f}",
            )
    console.print(table)
    console.print("× vector: the worker's peak resident memory minus what it held before the vector existed, in copies of the vector")
    for r in rows:
        if r["impl"] == "phalanx":
            verdict = "met" if r["vector_copies"] <= 4 else "NOT met"
            console.print(f"goal phalanx ≤ 4 copies of the vector at {r['peers']} peers: {r['vector_copies']:.2f} — {verdict}")
    if "phalanx" in impls and "hivemind" in impls:
        for world in peers:
            ref = {r["impl"]: r for r in rows if r["peers"] == world}
            speedup = ref["hivemind"]["data_s"] / ref["phalanx"]["data_s"]
            verdict = "met" if speedup >= 2 else "NOT met"
            console.print(f"goal ≥2× hivemind at {world} peers: {speedup:.2f}× — {verdict}")
    return rows


VERIFY_CASES = (  # (label, worker flags); "mean" is the reference of every ratio
    ("mean", ["--aggregator", "mean"]),
    ("CClip", ["--aggregator", "centered_clip", "--aggregator-params", "tau=1"]),
    ("CClip+verify", ["--aggregator", "centered_clip", "--aggregator-params", "tau=1", "--verify"]),
)


def run_verify_bench(
    peers: list[int], numel: int, rounds: int, upload_mbps: tuple[float, ...] = (0.0,), console=None
) -> list[dict[str, Any]]:
    """Plain mean vs CenteredClip vs CenteredClip with full BTARD verification, whole rounds.

    `upload_mbps` repeats the comparison with every peer's uploads capped (0: loopback, uncapped).
    On loopback moving 10M floats costs almost nothing, so the verification's fixed costs (hashing,
    projections, four small all-to-all phases) weigh most there; "CPU s/peer" is each peer process's
    own CPU time per round, which does not depend on how many peers share the machine's cores.
    """
    from rich.table import Table

    console = console or bench_console()
    rows = []
    for limit in upload_mbps:
        for world in peers:
            for label, extra in VERIFY_CASES:
                link = f", uploads capped at {limit:g} Mbit/s" if limit else ""
                console.print(f"running {label} with {world} peers × {numel:,} float32{link} ({rounds} timed rounds)…")
                row = run_case("phalanx", world, numel, rounds, extra=extra + (["--upload-mbps", str(limit)] if limit else []))
                row["label"], row["upload_mbps"] = label, limit
                rows.append(row)
    table = Table(title=f"verification cost, {numel:,} float32 per peer on loopback (median of {rounds} rounds)")
    for col in ("uplink", "peers", "round", "s/round", "× mean", "CPU s/peer", "× mean", "MB/peer", "× mean", "× vector"):
        table.add_column(col, justify="right", no_wrap=True)
    verdicts = []
    for limit in upload_mbps:
        for world in peers:
            group = [r for r in rows if r["peers"] == world and r["upload_mbps"] == limit]
            base = next(r for r in group if r["label"] == "mean")
            for r in group:
                table.add_row(
                    f"{limit:g} Mbit/s" if limit else "∞", str(world), r["label"], f"{r['round_s']:.3f}",
                    f"{r['round_s'] / base['round_s']:.2f}", f"{r['cpu_s_per_peer']:.3f}",
                    f"{r['cpu_s_per_peer'] / base['cpu_s_per_peer']:.2f}", f"{r['bytes_sent_per_peer'] / 1e6:.1f}",
                    f"{r['bytes_sent_per_peer'] / base['bytes_sent_per_peer']:.3f}", f"{r['vector_copies']:.2f}",
                )  # fmt: skip
            full = next(r for r in group if r["label"].endswith("verify"))
            t, b = full["round_s"] / base["round_s"], full["bytes_sent_per_peer"] / base["bytes_sent_per_peer"]
            verdict = "met" if t <= 1.3 and b <= 1.05 else "NOT met"
            link = f"uploads capped at {limit:g} Mbit/s" if limit else "uncapped loopback"
            verdicts.append(f"goal at {world} peers, {link}: time ≤ 1.3× and bytes ≤ 1.05× plain mean — {t:.2f}× and {b:.3f}×: {verdict}")
            for r in group:  # memory: a plain round within 4 copies of the vector, a verified one within 6
                most = 6 if r["label"].endswith("verify") else 4
                verdict = "met" if r["vector_copies"] <= most else "NOT met"
                verdicts.append(f"goal {r['label']} at {world} peers, {link}: ≤ {most} copies of the vector — {r['vector_copies']:.2f}: {verdict}")
    console.print(table)
    console.print("× vector: the worker's peak resident memory minus what it held before the vector existed, in copies of the vector")
    for line in verdicts:
        console.print(line)
    cores = os.cpu_count() or 1
    cpu = {(r["peers"], r["upload_mbps"], r["label"]): r["cpu_s_per_peer"] for r in rows}
    for world in (w for w in peers if w > cores):
        extra = statistics.mean(cpu[world, limit, "CClip+verify"] - cpu[world, limit, "mean"] for limit in upload_mbps)
        console.print(
            f"the {world} peers share {cores} CPU core{'s' if cores > 1 else ''} here: with fast links a round waits for "
            f"the CPU, and a verified peer spends {extra:.3f} CPU-s per round more than a plain-mean one"
        )
    return rows


if __name__ == "__main__":
    worker_main()
