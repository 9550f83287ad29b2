"""`phalanx bench cli`: wall time of `phalanx --help`, `phalanx join --help` and a mistyped flag,
each a fresh process, against the bare interpreter and `import torch` timed in the same run (the
CLI must answer these before loading torch, hivemind & co.)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

_PHALANX = [sys.executable, "-m", "phalanx"]
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "phalanx --help": [*_PHALANX, "--help"],
    "phalanx join --help": [*_PHALANX, "join", "--help"],
    "phalanx join --stesp 3 (typo)": [*_PHALANX, "join", "--stesp", "3"],
    "phalanx join --steps 0 (bad value)": [*_PHALANX, "join", "--steps", "0"],
}


def _wall_s(argv: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    started = time.perf_counter()
    subprocess.run(argv, capture_output=True, env=env, timeout=300, check=False)
    return time.perf_counter() - started


def run_cli_bench(repeats: int) -> dict[str, float]:
    """Median wall seconds per case; the cases run interleaved so machine load hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for name, argv in CASES.items():  # one warm-up each: the first run also fills the page cache
        _wall_s(argv)
    for _ in range(repeats):
        for name, argv in CASES.items():
            samples[name].append(_wall_s(argv))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    bare, torch = medians["python -c pass"], medians["python -c 'import torch'"]
    table = Table(title=f"CLI start-up, median of {repeats} (a fresh process each)")
    for column in ("command", "wall s", "÷ python -c pass", "÷ import torch"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for name, value in medians.items():
        table.add_row(name, f"{value:.3f}", f"{value / bare:.1f}×", f"{value / torch:.2f}×")
    Console().print(table)
    return medians
