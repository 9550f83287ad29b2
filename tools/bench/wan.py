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
    bad = sum(
        (last[n].rounds_partial + last[n].rounds_failed) - (first[n].rounds_partial + first[n].rounds_failed) for n in first
    )
    cell = Cell(case, rtt_ms, window_s / rounds if rounds else None, steps / window_s, rounds, bad, min(s.group for s in last.values()))
    log(f"{case} at RTT {rtt_ms:g} ms: {cell}")
    return cell


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
