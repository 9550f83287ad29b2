"""`phalanx bench wan`: how many round trips a round costs. A bootstrap and 4 trainers (digits-mlp, a
step of milliseconds), each on its own lab host (root), with the same added latency on every host;
for each case and round-trip time: seconds per round, the same in RTT units, steps/s, and each
against the same case at RTT ≈ 0, measured in the same run.

A round at RTT r costs t(r) = t(0) + k·r, where t(0) is compute and transfer on the lab's fast
links: k, "extra RTT", is how many round trips the protocol waits for, the number the latency
work drives down. A host's one-way delay d makes RTT 4·d between two hosts (each adds d each way).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from phalanx.errors import ConfigError

VERIFIED = ("--aggregator", "centered_clip", "--tau", "1", "--verify")
CASES: dict[str, tuple[str, ...]] = {
    "mean": ("--mode", "sync"),
    "centered-clip": ("--mode", "sync", "--aggregator", "centered_clip", "--tau", "1"),
    "verified": ("--mode", "sync", *VERIFIED),
    "diloco-int8": ("--mode", "diloco", "--compression", "int8", "--inner-steps", "50"),
    "verified-diloco": ("--mode", "diloco", "--compression", "int8", "--inner-steps", "50", *VERIFIED),
}
TRAINERS = 4
FORM_S = 180.0  # bound on one group of every trainer after the last start


@dataclass
class Cell:
    case: str
    rtt_ms: float
    s_per_round: Optional[float]  # the slowest trainer's window / its rounds done in it
    steps_per_s: float  # the slowest trainer's
    rounds: int  # fewest rounds a trainer completed in the window
    partial_or_failed: int  # rounds of the window that were not whole, every trainer together
    group: int  # smallest last group seen at the end of the window


def measure(case: str, rtt_ms: float, window_s: float, workdir: Path, log=print) -> Cell:
    """One swarm of `case` at `rtt_ms` between any two hosts; its numbers over `window_s` once all
    trainers train in one group."""
    from phalanx.tools.lab.swarm import LabSwarm

    swarm = LabSwarm(workdir, trainers=TRAINERS, join_args=CASES[case], tag=f"w{int(rtt_ms)}", checkpoints=False)
    try:
        for name in swarm.lab.hosts:
            swarm.lab.delay(name, rtt_ms / 4000.0)  # 0 keeps the proxy in the path: the same code at every RTT
        swarm.start()
        swarm.wait(lambda: swarm.training_together(min_step=1), FORM_S, f"{case} at {rtt_ms:g} ms: one group of all trainers")
        first = {n: swarm.peers[n].last() for n in swarm.trainer_names}
        time.sleep(window_s)
        last = {n: swarm.peers[n].last() for n in swarm.trainer_names}
    finally:
        swarm.close()
    rounds = min(last[n].rounds_done - first[n].rounds_done for n in first)
    steps = min(last[n].step - first[n].step for n in first)
    bad = not_whole(first, last)
    cell = Cell(case, rtt_ms, window_s / rounds if rounds else None, steps / window_s, rounds, bad, min(s.group for s in last.values()))
    log(f"{case} at RTT {rtt_ms:g} ms: {cell}")
    return cell


def not_whole(first: dict, last: dict) -> int:
    """Rounds between two polls of every trainer that were partial or failed, all trainers together."""
    return sum((last[n].rounds_partial + last[n].rounds_failed) - (first[n].rounds_partial + first[n].rounds_failed) for n in first)


def run_wan_bench(cases: list[str], rtts_ms: list[float], window_s: float, json_path: Optional[Path] = None) -> list[Cell]:
    from phalanx.tools.lab.hosts import missing_requirements, sweep_stale

    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise ConfigError(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    why = missing_requirements()
    if why:
        raise ConfigError(f"phalanx bench wan: {why}; run it as root on Linux")
    if 0 not in rtts_ms:
        rtts_ms = [0.0, *rtts_ms]  # the reference every ratio is taken against
    sweep_stale()
    cells = []
    with tempfile.TemporaryDirectory(prefix="phalanx-wan-") as tmp:
        for case in cases:
            for rtt in rtts_ms:
                cells.append(measure(case, rtt, window_s, Path(tmp) / f"{case}-{rtt:g}"))
    print_table(cells)
    if json_path is not None:
        json_path.write_text(json.dumps([asdict(c) for c in cells], indent=1))
    return cells


def extra_rtts(cell: Cell, reference: Cell) -> Optional[float]:
    """Round trips the protocol waits for per round: (t(r) − t(0)) / r."""
    if cell.rtt_ms == 0 or cell.s_per_round is None or reference.s_per_round is None:
        return None
    return (cell.s_per_round - reference.s_per_round) / (cell.rtt_ms / 1000.0)


def print_table(cells: list[Cell]) -> None:
    table = Table(title=f"Rounds at added latency: bootstrap + {TRAINERS} trainers, digits-mlp, one lab host each")
    for column in ("case", "RTT ms", "s/round", "RTT/round", "extra RTT", "steps/s", "÷ RTT 0", "not whole"):
        table.add_column(column, justify="left" if column == "case" else "right")
    references = {c.case: c for c in cells if c.rtt_ms == 0}
    for c in cells:
        ref = references.get(c.case)
        per_round = "-" if c.s_per_round is None else f"{c.s_per_round:.3f}"
        in_rtt = "-" if c.s_per_round is None or not c.rtt_ms else f"{c.s_per_round / (c.rtt_ms / 1000):.2f}"
        extra = extra_rtts(c, ref) if ref else None
        ratio = "-" if ref is None or not ref.steps_per_s else f"{c.steps_per_s / ref.steps_per_s:.2f}×"
        table.add_row(
            c.case, f"{c.rtt_ms:g}", per_round, in_rtt, "-" if extra is None else f"{extra:.2f}",
            f"{c.steps_per_s:.2f}", ratio, str(c.partial_or_failed),
        )  # fmt: skip
    Console(width=max(Console().width, 100)).print(table)


# ---- one far member among near ones: deadlines that adapt ----------------------------------


@dataclass
class FarMember:
    near_ms: float  # every host's one-way delay but the far trainer's
    far_ms: float
    window_s: float
    rounds: int  # the far trainer's rounds in the window
    not_whole: int  # rounds of the window that were not whole, every trainer together
    stalls_s: list[float]  # per SIGKILL: the longest time a survivor's step did not move
    bound_s: float  # 3 s plus 3 times the swarm's longest RTT

    @property
    def met(self) -> bool:
        return self.not_whole == 0 and bool(self.stalls_s) and max(self.stalls_s) <= self.bound_s


def measure_far_member(near_ms: float, far_ms: float, window_s: float, kills: int, workdir: Path, log=print) -> FarMember:
    """Bootstrap and trainers at `near_ms` one-way delay, trainer t4 at `far_ms`, default flags (mean, sync):
    the rounds of a window, then `kills` SIGKILLs of a near trainer's main process (each restarted, and
    waited for, before the next) and how long the others' steps stalled."""
    from phalanx.tools.lab.swarm import LabSwarm, longest_stall

    swarm = LabSwarm(workdir, trainers=TRAINERS, join_args=CASES["mean"], tag="far")  # (restarts --resume)
    far, victim = swarm.trainer_names[-1], swarm.trainer_names[0]
    try:
        for name in swarm.lab.hosts:
            swarm.lab.delay(name, (far_ms if name == far else near_ms) / 1000.0)
        swarm.start()
        swarm.wait(lambda: swarm.training_together(min_step=1), FORM_S, "one group of all trainers")
        first = {n: swarm.peers[n].last() for n in swarm.trainer_names}
        time.sleep(window_s)
        last = {n: swarm.peers[n].last() for n in swarm.trainer_names}
        bad = not_whole(first, last)
        rounds = last[far].rounds_done - first[far].rounds_done
        log(f"window of {window_s:g} s: the far trainer took part in {rounds} rounds; {bad} rounds not whole")
        stalls = []
        survivors = [n for n in swarm.trainer_names if n != victim]
        for kill in range(kills):
            t0 = time.monotonic()
            swarm.signal_main(victim, 9)
            time.sleep(15.0)
            t1 = time.monotonic()
            stall = max(longest_stall(swarm.peers[n].samples, t0, t1) for n in survivors)
            stalls.append(stall)
            log(f"SIGKILL {kill + 1} of {victim}: the survivors' longest stall {stall:.1f} s")
            swarm.reap(victim)
            swarm.restart(victim)
            swarm.wait(lambda: swarm.training_together(min_step=1), FORM_S, f"{victim} back in one group of all")
    finally:
        swarm.close()
    rtt_s = 2 * (near_ms + far_ms) / 1000.0  # the swarm's longest: the far trainer's to the others
    return FarMember(near_ms, far_ms, window_s, rounds, bad, stalls, 3.0 + 3 * rtt_s)


def run_far_member_bench(
    near_ms: float, far_ms: float, window_s: float, kills: int, json_path: Optional[Path] = None, logs: Optional[Path] = None
) -> FarMember:
    """`logs`: a folder to keep the peers' logs in (else a temporary one, removed after)."""
    from phalanx.tools.lab.hosts import missing_requirements, sweep_stale

    why = missing_requirements()
    if why:
        raise ConfigError(f"phalanx bench far-member: {why}; run it as root on Linux")
    if logs is not None and logs.exists() and any(logs.iterdir()):
        raise ConfigError(f"--logs: {logs} is not empty; name a new or empty folder")
    sweep_stale()
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        result = measure_far_member(near_ms, far_ms, window_s, kills, logs)
    else:
        with tempfile.TemporaryDirectory(prefix="phalanx-far-") as tmp:
            result = measure_far_member(near_ms, far_ms, window_s, kills, Path(tmp))
    table = Table(title=f"One trainer at {far_ms:g} ms one-way among hosts at {near_ms:g} ms (default flags, mean)")
    for column in ("far trainer's rounds", "rounds not whole", "stall per SIGKILL (s)", "goal (s)", "met"):
        table.add_column(column, justify="right")
    stalls = ", ".join(f"{s:.1f}" for s in result.stalls_s) or "-"
    table.add_row(str(result.rounds), str(result.not_whole), stalls, f"≤ {result.bound_s:.2f}", "yes" if result.met else "no")
    Console(width=max(Console().width, 100)).print(table)
    if json_path is not None:
        json_path.write_text(json.dumps({**asdict(result), "met": result.met}, indent=1))
    return result
