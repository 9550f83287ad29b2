"""Checks that need no network: initial-peer address form, ports bindable, identity file, task and
its data, device, disk for checkpoints. `phalanx join` runs these before it starts anything."""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path
from typing import Optional

from phalanx.errors import ConfigError
from phalanx.peer.config import PeerConfig
from phalanx.security.identity import is_peer_id
from phalanx.tools.doctor.rows import Row, failed, ok

BOOTSTRAP_LINE = "copy the whole --initial-peers line that `phalanx bootstrap` printed"


def short(peer_id: str) -> str:
    return "…" + peer_id[-8:]


def peer_id_of(addr: str) -> Optional[str]:
    """The /p2p/<id> part of a multiaddr, or None."""
    parts = addr.split("/")
    last = max((i for i, p in enumerate(parts[:-1]) if p == "p2p"), default=None)  # a relay's own ID comes first
    return None if last is None else parts[last + 1]


def multiaddr_row(addr: str) -> Row:
    """An initial peer must be a multiaddr with a host, a TCP port and the peer ID to expect there."""
    from multiaddr import Multiaddr

    peer = peer_id_of(addr)
    check = f"initial peer {short(peer) if peer and is_peer_id(peer) else addr}: address"

    try:
        maddr = Multiaddr(addr)
    except Exception as e:
        return failed(check, f"not a multiaddr ({str(e)[:120]})", f"use the form /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW…: {BOOTSTRAP_LINE}")
    names = [p.name for p in maddr.protocols()]
    if peer is None:
        return failed(check, "has no /p2p/<peer id> part (libp2p cannot verify whom it reaches)", f"append /p2p/<the peer's ID>: {BOOTSTRAP_LINE}")
    if not is_peer_id(peer):
        return failed(check, f"/p2p/{peer} is not a peer ID", BOOTSTRAP_LINE)
    if not {"ip4", "ip6", "dns", "dns4", "dns6"} & set(names) or not {"tcp", "udp"} & set(names):
        return failed(check, "names no host and port", f"use the form /ip4/1.2.3.4/tcp/31337/p2p/{peer}")
    return ok(check, f"{addr}: peer {short(peer)} at {host_port(maddr)}")


def host_port(maddr) -> str:
    for proto in ("ip4", "ip6", "dns", "dns4", "dns6"):
        for transport in ("tcp", "udp"):
            try:
                return f"{maddr.value_for_protocol(proto)}:{maddr.value_for_protocol(transport)}"
            except Exception:
                continue
    return str(maddr)


def _bind_row(check: str, flag: str, host: str, port: int) -> Row:
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return failed(check, f"{host}:{port} is in use by another process", f"pick another {flag} (0: any free port), or stop what holds it (ss -ltnp 'sport = :{port}')")
        if e.errno == errno.EACCES:
            return failed(check, f"{host}:{port} needs root (ports below 1024)", f"use {flag} 1024 or above")
        if e.errno == errno.EADDRNOTAVAIL:
            return failed(check, f"{host} is not an address of this machine", f"listen on 0.0.0.0 or one of this machine's addresses ({flag})")
        return failed(check, f"cannot listen on {host}:{port}: {e.strerror}", f"pick another {flag}")
    return ok(check, f"{host}:{port} is free" if port else f"{host}: any free port")


def listen_host(settings: PeerConfig) -> str:
    """The host the libp2p and direct listeners bind (the first --host-maddrs, as the transport does)."""
    from multiaddr import Multiaddr

    try:
        return Multiaddr(settings.listen_maddrs()[0]).value_for_protocol("ip4")
    except Exception:
        return "0.0.0.0"


def port_rows(settings: PeerConfig) -> list[Row]:
    """Every fixed port this peer will listen on can be bound now."""
    from multiaddr import Multiaddr

    rows = []
    for addr in settings.listen_maddrs():
        try:
            maddr = Multiaddr(addr)
            host, port = maddr.value_for_protocol("ip4"), int(maddr.value_for_protocol("tcp"))
        except Exception:
            continue  # ip6, quic, …: p2pd's own start-up tells
        flag = "--host-maddrs" if settings.host_maddrs else "--port"
        rows.append(_bind_row("libp2p port", flag, host, port))
    if not settings.direct:
        rows.append(ok("direct data port", "--no-direct: bulk tensor bytes take libp2p streams"))
    else:
        rows.append(_bind_row("direct data port", "--direct-port", listen_host(settings), settings.direct_port))
    if settings.http_port:
        rows.append(_bind_row("http port", "--http-port", settings.http_host, settings.http_port))
    return rows


def identity_row(settings: PeerConfig) -> Row:
    check, path = "identity file", settings.identity_path
    if path is None:
        return ok(check, "none: a new peer ID at every start (--identity-path keeps one)")
    if path.is_dir():
        return failed(check, f"{str(path)!r} is a directory", "--identity-path names a key file (created if missing)")
    if not path.exists():
        if not path.parent.is_dir():
            return failed(check, f"directory {str(path.parent)!r} does not exist", "create it, or point --identity-path elsewhere")
        if not os.access(path.parent, os.W_OK):
            return failed(check, f"cannot create {str(path)!r}: {str(path.parent)!r} is not writable", "point --identity-path at a writable folder")
        return ok(check, f"{str(path)!r} will be created at the first start")
    from phalanx.security.identity import Identity

    try:
        identity = Identity.load(path)
    except ConfigError as e:
        return failed(check, str(e).removeprefix("--identity-path: "), "point --identity-path at a key written by `phalanx keygen --identity-path` (or a missing file, to create one)")
    return ok(check, f"{str(path)!r}: peer {identity.peer_id}")


def task_rows(settings: PeerConfig) -> list[Row]:
    """Task resolvable with its data, the device usable, and room for checkpoints."""
    from phalanx.peer.model import resolve_device
    from phalanx.tasks import resolve_task

    rows = []
    options = {"data_dir": settings.data_dir} if settings.data_dir is not None else {}
    try:
        task = resolve_task(settings.task, **options)
    except ConfigError as e:
        task = None
        seen, _, fix = str(e).removeprefix("task ").partition("; ")  # the task's message carries its own fix
        rows.append(failed("task", seen, fix or "fix --task / --data-dir (see `phalanx join --help` for the built-in tasks)"))
    else:
        rows.append(ok("task", f"{settings.task}: {len(task.train_targets)} training and {len(task.test_targets)} test samples"))
        rows.append(target_row(settings, task))
    try:
        device = resolve_device(settings.device)
    except ConfigError as e:
        seen = str(e).split(": ", 1)[-1].split("; ")[0]  # the message without its flag and advice, which the fix gives
        rows.append(failed("device", seen, f"--device {settings.device} is not usable here: use --device cpu or auto, or a cuda:N that exists (a CUDA build of torch sees the GPUs)"))
    else:
        rows.append(ok("device", _describe(device)))
    rows.append(disk_row(settings, task))
    return rows


def target_row(settings: PeerConfig, task) -> Row:
    """The target flag given is the one of the task's metric (--target-loss for a language model)."""
    from phalanx.peer.trainer import run_target

    try:
        target = run_target(task, settings)
    except ConfigError as e:
        seen, _, fix = str(e).partition("; ")
        return failed("target", seen, fix)
    if target is None:
        return ok("target", f"none: trains until --steps or stopped (judged by its {task.metric.label})")
    return ok("target", f"{task.metric.label} {'≥' if task.metric.higher_is_better else '≤'} {target:g}")


def _describe(device) -> str:
    import torch

    if device.type != "cuda":
        return "cpu" + ("" if torch.cuda.is_available() else " (no CUDA GPU visible to torch)")
    free, total = torch.cuda.mem_get_info(device)
    return f"{device}: {torch.cuda.get_device_name(device)}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"


def disk_row(settings: PeerConfig, task) -> Row:
    check, folder = "checkpoint disk", settings.checkpoint_dir
    if folder is None:
        return ok(check, "no --checkpoint-dir: nothing is saved")
    existing = Path(folder).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return failed(check, f"{str(existing)!r} is a file", "point --checkpoint-dir at a folder")
    if not os.access(existing, os.W_OK):
        return failed(check, f"{str(existing)!r} is not writable", "point --checkpoint-dir at a writable folder")
    free = shutil.disk_usage(existing).free
    # model + optimizer state (≈ 3 × the parameters) for each kept checkpoint and one being written
    need = 0 if task is None else 3 * _model_bytes(task, settings.seed) * (settings.checkpoint_keep + 1)
    if free < need:
        return failed(check, f"{free / 2**20:.0f} MiB free at {str(existing)!r}, {need / 2**20:.0f} MiB needed for {settings.checkpoint_keep} checkpoints", "free some disk, lower --checkpoint-keep or point --checkpoint-dir elsewhere")
    return ok(check, f"{free / 2**30:.1f} GiB free at {str(existing)!r}" + (f" ({need / 2**20:.1f} MiB needed)" if need else ""))


def _model_bytes(task, seed: int) -> int:
    return sum(p.numel() * p.element_size() for p in task.build_model(seed).parameters())


def cheap_rows(settings: PeerConfig, initial_peers: list[str]) -> list[Row]:
    """Every check that needs no network, in the order the table shows them."""
    rows = [multiaddr_row(a) for a in initial_peers]
    rows += port_rows(settings)
    rows.append(identity_row(settings))
    rows += task_rows(settings)
    return rows
