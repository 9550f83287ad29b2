"""`phalanx bench state-sync`: downloading a state from one donor against downloading it from several.

Each donor is its own process with its own libp2p daemon and its upload capped (the transport's
upload limiter), all on loopback; they publish the same state after one round id. The bench
process is the recipient: for every donor count it downloads the whole state with
`StateService.fetch_from` (one donor: the plain download; more: disjoint chunks from each at
once, each checked against the designated donor's digests) and checks every byte.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any, Optional

import torch

from phalanx.errors import ConfigError
from phalanx.tools.bench import bench_console

ROUND_ID = b"bench-state-sync"
NAMESPACE = "bench-state"


def bench_state(params: int) -> dict[str, torch.Tensor]:
    """The state every donor holds: parameters and one optimizer buffer, the same on every donor."""
    half = params // 2
    return {
        "params": torch.arange(half, dtype=torch.float32).mul_(1e-6),
        "momentum": torch.arange(params - half, dtype=torch.float32).mul_(-1e-7),
    }


def _donor(maddrs: list[str], params: int, upload_bytes_per_s: float, conn: Any) -> None:
    """A donor process: publish the state, send the peer ID, serve until the recipient closes the pipe."""

    async def main() -> None:
        from hivemind.p2p import P2P

        from phalanx.protocol.state_sync import StateService, StateSnapshot
        from phalanx.protocol.transport import Transport

        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs, nat_port_map=False)
        transport = await Transport.open(
            p2p, namespace=NAMESPACE, direct_host="127.0.0.1", upload_limit_bytes_per_s=upload_bytes_per_s
        )
        try:
            service = StateService(transport)
            await service.publish(StateSnapshot(step=1, version=b"v", tensors=bench_state(params)), ROUND_ID)
            conn.send(transport.peer_id)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv_bytes)  # EOF when the recipient is done
        except EOFError:
            pass
        finally:
            await transport.aclose()
            await p2p.shutdown()

    try:
        asyncio.run(main())
    except EOFError:
        pass


def run_state_sync_bench(
    params: int, donor_counts: list[int], upload_mbit: float, repeats: int, json_path: Optional[Path]
) -> list[dict[str, Any]]:
    if not donor_counts or min(donor_counts) < 1 or max(donor_counts) > 16:
        raise ConfigError("--donors: use donor counts from 1 to 16, e.g. 1,4")
    if 1 not in donor_counts:
        donor_counts = [1, *donor_counts]  # the reference
    rows = asyncio.run(_recipient(params, sorted(set(donor_counts)), upload_mbit, repeats))
    _print(rows, params, upload_mbit)
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=1))
    return rows


async def _recipient(params: int, donor_counts: list[int], upload_mbit: float, repeats: int) -> list[dict[str, Any]]:
    from hivemind.p2p import P2P

    from phalanx.protocol.state_sync import CHUNK_BYTES, StateService
    from phalanx.protocol.transport import Transport

    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    transport = await Transport.open(p2p, namespace=NAMESPACE, direct_host="127.0.0.1")
    context = multiprocessing.get_context("spawn")
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    procs, pipes = [], []
    try:
        for _ in range(max(donor_counts)):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_donor, args=(maddrs, params, upload_mbit * 1e6 / 8, theirs), daemon=True)
            proc.start()
            procs.append(proc)
            pipes.append(ours)
        loop = asyncio.get_running_loop()
        donors = [await loop.run_in_executor(None, _receive, pipe) for pipe in pipes]
        service = StateService(transport)
        expected = bench_state(params)
        template = {k: torch.empty_like(v) for k, v in expected.items()}
        size = sum(v.numel() * v.element_size() for v in expected.values())
        rows = []
        for count in donor_counts:
            times = []
            for _ in range(repeats):
                began = time.perf_counter()
                got = await service.fetch_from(donors[:count], ROUND_ID, template, timeout_s=600)
                times.append(time.perf_counter() - began)
                if not all(torch.equal(got.tensors[k], v) for k, v in expected.items()):
                    raise RuntimeError(f"the state from {count} donor(s) differs from the one they published")
                del got
            best = min(times)
            rows.append(
                {
                    "donors": count,
                    "seconds": best,
                    "mb_per_s": size / best / 1e6,
                    "chunks": -(-size // CHUNK_BYTES),
                    "refetched_chunks": service.refetched_chunks,
                    "bytes": size,
                }
            )
        reference = rows[0]["seconds"]
        for row in rows:
            row["ratio"] = row["seconds"] / reference
        return rows
    finally:
        for pipe in pipes:
            pipe.close()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        await transport.aclose()
        await p2p.shutdown()


def _receive(pipe: Any) -> str:
    if not pipe.poll(120):
        raise RuntimeError("a donor process did not publish its state within 120 s")
    return pipe.recv()


def _print(rows: list[dict[str, Any]], params: int, upload_mbit: float) -> None:
    from rich.table import Table

    size = rows[0]["bytes"]
    table = Table(
        title=f"state download: {params:,} float32 values ({size / 1e6:.0f} MB), each donor's upload capped at "
        f"{upload_mbit:g} Mbit/s, loopback",
        title_justify="left",
    )
    for name in ("donors", "seconds", "MB/s", "÷ one donor", "chunks re-downloaded"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(
            str(row["donors"]), f"{row['seconds']:.2f}", f"{row['mb_per_s']:.1f}", f"{row['ratio']:.2f}",
            str(row["refetched_chunks"]),
        )  # fmt: skip
    bench_console().print(table)
