"""What `phalanx swarm` says about its peers: why each one exited (from its exit code, its final
report and the last error line of its log), how start-up went, and the final table."""

from __future__ import annotations

import math
import re
import signal
import statistics
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from phalanx.tools.launcher.views import PeerView, SwarmResult

# `phalanx join` exits 3 when it stopped before reaching its target (--target-accuracy or --target-loss:
# steps done, or stopped by a signal), 2 on a user's mistake (one `error: …` line) and 1 on any other error.
TARGET_NOT_REACHED = 3
_ERROR_LINES = (
    re.compile(r"^error: "),  # the CLI's one-line errors
    re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit)\b"),  # a traceback's last line
    re.compile(r"^\d\d:\d\d:\d\d [EC] "),  # our text log format, levels ERROR and CRITICAL
    re.compile(r"\[(?:ERROR|CRITICAL)\]"),  # hivemind's own format
    re.compile(r'"level": "(?:error|critical)"'),  # --log-format json
)
TAIL_BYTES = 64 << 10
MAX_LINE = 2000


def last_error_line(log: Path) -> Optional[str]:
    """The last line of `log` that reports an error (else its last line; None if it is empty)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return error_line(text)


def error_line(text: str) -> Optional[str]:
    """The last line of `text` that reports an error (else its last line; None if it is empty)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(p.search(line) for p in _ERROR_LINES):
            return line[:MAX_LINE]
    return lines[-1][:MAX_LINE] if lines else None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_reason(view: PeerView, *, steps: Optional[int], swarm_reached_target: bool) -> str:
    """One phrase: why this peer's process ended."""
    code, report = view.exit_code, view.report or {}
    if code is None:
        return "still running"
    if code < 0:
        if view.stop_sent and -code == signal.SIGTERM:
            return "stopped by the launcher (SIGTERM, before it was up)"
        return f"killed by {signal_name(-code)}" + (" (it did not stop in time)" if view.stop_sent else "")
    if code in (0, TARGET_NOT_REACHED) and view.report is not None:
        if report.get("reached_target"):
            return "target reached"
        if steps is not None and report.get("step", 0) >= steps:
            return "steps done" + (", target not reached" if code == TARGET_NOT_REACHED else "")
        if view.stop_sent:
            return "stopped: another peer reached the target" if swarm_reached_target else "stopped by the launcher"
        return "finished"
    if not view.last_error:
        return f"error: exit code {code}, nothing in its log"
    return "error: " + view.last_error.removeprefix("error: ")


def is_failure(reason: str) -> bool:
    return reason.startswith("error") or reason.startswith("killed")


def _bans(banned: list[str], attackers: set[str]) -> str:
    if not banned:
        return ""
    caught = sum(p in attackers for p in banned)
    return f"{len(banned)} ({caught} attackers)" if attackers else str(len(banned))


def startup_line(result: SwarmResult) -> str:
    """Time to the first step, and when each start-up stage was reached by every trainer."""
    marks = result.startup
    if marks.get("first step") is None:
        reached = [f"{name} {t:.1f} s" for name, t in marks.items() if t is not None]
        return "no trainer took a step" + (f" ({', '.join(reached)})" if reached else "")
    stages = ", ".join(f"{name} {t:.1f} s" for name, t in marks.items() if t is not None and name != "first step")
    return f"time to first step {marks['first step']:.1f} s ({stages})"


def spread_line(result: SwarmResult) -> Optional[str]:
    """How far the farthest trainer's parameters are from the trainers' mean (relative), from the count
    sketches their final reports carry (--group-size); None without two of them."""
    sketches = [(v.name, (v.report or {}).get("param_sketch")) for v in result.peers]
    sketches = [(name, s) for name, s in sketches if s]
    if len(sketches) < 2:
        return None
    mean = [math.fsum(column) / len(sketches) for column in zip(*(s for _, s in sketches), strict=True)]
    scale = math.hypot(*mean) or math.inf
    distances = [math.dist(s, mean) / scale for _, s in sketches]
    worst = max(range(len(sketches)), key=distances.__getitem__)
    return (
        f"parameters: every trainer within {distances[worst]:.1e} of the trainers' mean (relative; farthest "
        f"{sketches[worst][0]}, estimated from sketches of {len(mean)} numbers)"
    )


def memory_line(result: SwarmResult) -> Optional[str]:
    """Peak resident memory per trainer process (its DHT process and p2pd aside)."""
    peaks = [p for v in result.peers if (p := (v.report or {}).get("peak_rss_bytes"))]
    if not peaks:
        return None
    return (
        f"peak memory per trainer: median {statistics.median(peaks) / 2**20:.0f} MiB, max {max(peaks) / 2**20:.0f} MiB "
        "(its DHT process and p2pd aside)"
    )


def print_report(result: SwarmResult, console: Console) -> None:
    """The final table (each trainer's last value of the task's metric) and the run's summary lines."""
    metric, target = result.metric, result.target
    table = Table(title="final report")
    attackers = {v.peer_id for v in result.peers if v.attack and v.peer_id}
    columns = ("peer", "id", "steps", *metric.columns, "rounds ok", "partial", "failed", "resyncs", "sent MB", "banned", "exit", "why")
    for col in columns:
        if col == "why":  # the whole line was printed when the peer exited
            # the other columns need about 100 characters (11 more for perplexity's)
            room = max(14, min(40, console.width - 89 - 11 * len(metric.columns)))
            table.add_column(col, min_width=14, max_width=room, no_wrap=True, overflow="ellipsis")
        elif col == "peer":
            table.add_column(col, no_wrap=True, min_width=11)
        else:
            table.add_column(col, justify="left" if col in ("peer", "id", "banned") else "right")
    for v in result.peers:
        r = v.report or {}
        rounds = r.get("rounds", {})  # the trainer's "done" event: its RoundCounts
        table.add_row(
            v.name,
            v.peer_id[-8:],
            str(r.get("step", v.step)),
            *metric.cells(v.metric_value),
            *(str(rounds.get(outcome, "")) for outcome in ("ok", "partial", "failed", "resyncs")),
            f"{r.get('bytes_sent', v.bytes_sent) / 1e6:.2f}",
            _bans(r.get("banned", []), attackers),
            "" if v.exit_code is None else str(v.exit_code),
            result.reasons.get(v.name, ""),
        )
    console.print(table)
    byzantine = [v for v in result.peers if v.attack]
    if byzantine:
        kinds = ", ".join(sorted({v.attack for v in byzantine}))
        console.print(f"banned: how many peers each one saw banned, and how many of those are the {len(byzantine)} attackers ({kinds})")
    console.print(startup_line(result), soft_wrap=True)
    for line in (spread_line(result), memory_line(result)):
        if line is not None:
            console.print(line, soft_wrap=True)
    line = f"wall time {result.wall_s:.1f} s, best {metric.text(result.best)}"
    if target is not None:
        if result.reached_target:
            line += f", reached {target} after {result.time_to_target_s:.1f} s"
        else:
            line += f", target {target} NOT reached"
    console.print(line)
    if result.kept_workdir is not None:
        console.print(f"logs, identities and checkpoints of this run are kept in {result.kept_workdir}", soft_wrap=True)
