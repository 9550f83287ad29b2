"""`phalanx bench replay`: how far two honest replays of the same H inner steps differ.

A validator of a verified diloco round replays a member's H inner steps from θ_t on its public
batches and compares the pseudo-gradient with what the member committed to, part by part, within
`contribution_rtol` (relative L2 norm). Replays differ only where floating-point sums are split
differently: other thread counts here, other hardware elsewhere. This runs the same replay in a
process per thread count and prints each one's relative difference to the first (whole vector and
worst part) against the tolerance. Each replay may run on its own device: two on one GPU show what that
GPU's kernels vary, one beside a CPU replay what a validator on other hardware sees.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from phalanx.errors import ConfigError
from phalanx.tools.bench import bench_console

PEER = "12D3KooWreplay"


def _replay(task: str, options: str, inner_steps: int, threads: int, device: str, out: Path) -> None:
    from phalanx.peer.config import PeerConfig
    from phalanx.peer.model import Model, resolve_device, zero_optimizer_state
    from phalanx.peer.plan import make_plan
    from phalanx.peer.trainer import task_options
    from phalanx.tasks import compute_gradient, resolve_task

    torch.set_num_threads(threads)
    config = make_plan(PeerConfig(task=task, task_options=options, mode="diloco", device=device)).training
    resolved = resolve_task(task, **task_options(config)).to(resolve_device(device))
    model = Model(resolved, config)
    theta = torch.nn.utils.parameters_to_vector(model.params).detach().clone()
    zero_optimizer_state(model.optimizer)  # a verified phase's start
    for step in range(inner_steps):
        _, grad = compute_gradient(resolved, model.module, config.seed, PEER, step, resolved.batch_size)
        model.apply(grad, step)
    torch.save((theta - torch.nn.utils.parameters_to_vector(model.params).detach()).cpu(), out)


def run_replay_bench(
    task: str, options: str, inner_steps: int, threads: list[int], parts: int, devices: tuple[str, ...] = ("cpu",),
    console=None,
) -> list[dict]:  # fmt: skip
    """One replay per entry of `threads` and `devices` (a single entry of either applies to every replay);
    the rows of the table, each against the first replay."""
    from rich.table import Table

    from phalanx.peer.model import resolve_device
    from phalanx.protocol.config import VerifyConfig

    console = console or bench_console()
    count = max(len(threads), len(devices))
    if {len(threads), len(devices)} - {1, count}:
        raise ConfigError(f"--threads and --devices: give one value or {count} of each, not {len(threads)} and {len(devices)}")
    # a list of one value is repeated for every replay
    replays = list(zip(list(threads) * (count // len(threads)), list(devices) * (count // len(devices))))
    for device in set(devices):
        resolve_device(device)  # a device this machine lacks is one line here, not a replay's traceback
    rtol = VerifyConfig(tau=float("inf")).contribution_rtol
    with tempfile.TemporaryDirectory(prefix="phalanx-replay-") as tmp:
        deltas = []
        for i, (n, device) in enumerate(replays):
            out = Path(tmp) / f"{i}.pt"
            console.print(f"replaying {inner_steps} inner steps of {task} on {device}, {n} thread(s)…")
            subprocess.run(
                [sys.executable, "-m", "phalanx.tools.bench.replay", task, options, str(inner_steps), str(n), device, str(out)],
                check=True,
            )  # fmt: skip
            deltas.append(torch.load(out, weights_only=True))
    first = f"{replays[0][1]}, {replays[0][0]} thread(s)"
    table = Table(title=f"{task}, H = {inner_steps}: replays against the first ({first})")
    for col in ("device", "threads", "‖Δ‖", "whole vector", f"worst of {parts} parts", "tolerance", "margin"):
        table.add_column(col, justify="right")
    reference, rows = deltas[0], []
    for (n, device), delta in zip(replays, deltas, strict=True):
        whole = float((delta - reference).norm() / reference.norm())
        worst = max(float((a - b).norm() / b.norm()) for a, b in zip(delta.chunk(parts), reference.chunk(parts), strict=True))
        margin = "identical" if worst == 0 else f"{rtol / worst:.0f}×"
        table.add_row(device, str(n), f"{float(delta.norm()):.4g}", f"{whole:.2e}", f"{worst:.2e}", f"{rtol:.0e}", margin)
        rows.append({"device": device, "threads": n, "whole": whole, "worst_part": worst, "tolerance": rtol})
    console.print(table)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("task", "options", "inner_steps", "threads", "device", "out"):
        parser.add_argument(name)
    a = parser.parse_args()
    _replay(a.task, a.options, int(a.inner_steps), int(a.threads), a.device, Path(a.out))
