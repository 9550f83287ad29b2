"""The process table, read from /proc: which processes live, and which run below a peer's main one
(a SIGKILLed peer's DHT process or p2pd daemon left behind); and entering a lab host's network
namespace, which a thread or a fresh fork does before it opens a socket."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")


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


def enter_netns(name: str) -> None:
    """Move the calling thread (only it, and what it starts later) into network namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)
