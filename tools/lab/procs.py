"""The process table, read from /proc: which processes live, and which run below a peer's main one
(a SIGKILLed peer's DHT process or p2pd daemon left behind)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def processes() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # exited meanwhile
        yield int(stat.parent.name), state, int(ppid), int(pgrp)


def alive(pid: int) -> bool:
    """`pid` runs (a zombie is gone, only not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (not `pid` itself), whatever its session (torch's shared-memory
    manager has its own)."""
    table = [(p, state, ppid) for p, state, ppid, _ in processes()]
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, state, ppid in table if ppid in frontier and state != "Z"]
        found += below
        frontier = below
    return found
