"""A peer's network stack: hivemind DHT (its own process and p2pd), a P2P replica on our
loop, the transport, membership and the round engine. `open_node` / `Node.aclose`."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import hivemind
from hivemind.dht import DHTNode
from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from phalanx.errors import ConfigError, PeerProtocolError, PhalanxError
from phalanx.peer.config import NetworkSettings
from phalanx.peer.dht_keys import DhtKey, install, run_keys
from phalanx.peer.lifeline import exit_with_parent
from phalanx.peer.ports import check_listen_ports, maps_ports
from phalanx.protocol.admission import AdmissionGate
from phalanx.protocol.bans import BanBook
from phalanx.protocol.dht_calls import DHT_DIED, in_dht
from phalanx.protocol.dial_back import DialBackService, dialable
from phalanx.protocol.engine import RoundEngine
from phalanx.protocol.hop_relay import HopRelay
from phalanx.protocol.membership import LEADER_PERIOD_S, Membership
from phalanx.protocol.redial import Redialer
from phalanx.protocol.relays import RelayKeeper
from phalanx.protocol.round_counts import RoundCounts
from phalanx.protocol.transport import Transport
from phalanx.security.admission import load_owner_public
from phalanx.security.identity import Identity

if TYPE_CHECKING:
    from phalanx.peer.plan import PeerPlan

logger = logging.getLogger(__name__)

RELAY_TIME_LIMIT_S = 7 * 24 * 3600  # a relayed connection may last a week-long run
RELAY_TIME_LIMIT = f"{RELAY_TIME_LIMIT_S // 3600}h"
RELAY_MAX_CIRCUITS = 128  # relayed connections per peer: each home keeps one to every other relayed trainer
LEAVE_ROUND_S = 10.0  # bound on a closing peer's last round, the one it joined early (RoundEngine.leave)
WAIT_READ_S = 1.0  # how often a trainer waiting for --wait-for-peers looks at the membership's view


class _DHT(hivemind.DHT):
    """hivemind's DHT process, made to die with its process group and with its parent.

    The process is forked from a parent whose Python signal handlers (the trainer's graceful
    stop) would otherwise be inherited: it would then ignore SIGTERM and outlive a killed
    swarm. Ctrl-C reaches the whole process group; the parent decides how to stop, so the
    child ignores SIGINT and is shut down by the parent. A parent killed outright (SIGKILL,
    the OOM killer) cannot do that, so the child stops p2pd and exits once its parent is gone:
    nothing of a dead peer keeps its identity.
    """

    def __init__(self, *args, p2pd_flags: Optional[dict] = None, **kwargs) -> None:
        self._p2pd_flags = dict(p2pd_flags or {})  # before Process.__init__: `start=True` forks at once
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        if self._p2pd_flags:
            _add_p2pd_flags(self._p2pd_flags)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exit_with_parent(multiprocessing.parent_process().pid, self._stop_daemon)
        super().run()

    def _stop_daemon(self) -> None:
        """Stop this process's p2pd and remove its socket files, from a thread other than the loop's."""
        p2p = getattr(getattr(self, "_node", None), "p2p", None)
        if p2p is None:
            return  # not started yet: p2pd, if it is being started, exits when this process does
        child = getattr(p2p, "_child", None)  # hivemind's handle of the p2pd it spawned
        if child is not None and child.returncode is None:
            with suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)
        for maddr in (p2p.daemon_listen_maddr, getattr(p2p, "_client_listen_maddr", None)):
            if maddr is not None:
                socket_file(maddr).unlink(missing_ok=True)


def _add_p2pd_flags(flags: dict) -> None:
    """(In the DHT process only.) Pass p2pd flags that hivemind's `P2P.create` has no parameter for."""
    make = P2P._make_process_args

    def with_flags(*args, **kwargs) -> list[str]:
        return make(*args, **{**kwargs, **flags})

    P2P._make_process_args = staticmethod(with_flags)


def relay_flags(settings: NetworkSettings, relays: Sequence[str] = ()) -> tuple[dict, dict]:
    """(P2P.create arguments, extra p2pd flags) for relays. With `relays` (the initial peers of a peer
    nobody can dial), p2pd reserves a slot on each at once (libp2p's relay discovery would wait minutes
    for candidates) and reachability is private, so it keeps them. A peer with no initial peer is a
    swarm's entry point, dialable by definition: it serves as a relay whatever AutoNAT concludes (AutoNAT
    never dials private addresses), up to --relay-budget-gb each way per relayed connection, for as long as
    a run lasts (libp2p's 30 min default would cut a long run's relayed connections)."""
    if relays:
        return dict(force_reachability="private", use_auto_relay=True, trusted_relays=list(relays)), {"relayDiscovery": False}
    if settings.initial_peers or not settings.use_relay:
        return {}, {}
    if settings.relay_budget_gb <= 0:
        return {}, {"relayService": False}
    budget = {
        "relayDataLimit": int(settings.relay_budget_gb * 1e9), "relayTimeLimit": RELAY_TIME_LIMIT,
        "relayMaxCircuits": RELAY_MAX_CIRCUITS,
    }  # fmt: skip
    return dict(force_reachability="public"), budget


async def serve_relay(p2p: P2P, settings: NetworkSettings) -> Optional[HopRelay]:
    """Our relay on `p2p`, in place of p2pd's, for a peer that serves as one (`relay_flags`); else None.
    p2pd's own relay may come up with libp2p's default limits (see `protocol.hop_relay`)."""
    extra = relay_flags(settings)[1]
    if "relayDataLimit" not in extra:
        return None
    relay = HopRelay(p2p, data_limit=extra["relayDataLimit"], time_limit_s=RELAY_TIME_LIMIT_S, max_circuits=RELAY_MAX_CIRCUITS)
    await relay.start()
    return relay


def load_identity(settings: NetworkSettings, scratch: Path) -> tuple[Path, Identity]:
    """The identity file this peer runs with, and its key (to sign messages).

    A missing --identity-path file is created (RSA, as hivemind does); without the flag a
    throwaway Ed25519 identity is written to `scratch`, so the process always holds the
    private key behind its peer ID.
    """
    path = settings.identity_path
    if path is None:
        path = scratch / "identity.key"
        return path, Identity.generate_ed25519(path)
    if not path.parent.is_dir():
        raise ConfigError(f"--identity-path: directory {str(path.parent)!r} does not exist")
    if not path.exists():
        P2P.generate_identity(str(path))
    return path, Identity.load(path)


def start_dht_as(settings: NetworkSettings, prefix: str, relays: Sequence[str] = ()) -> tuple[hivemind.DHT, Identity]:
    """The DHT under this peer's identity (see `load_identity`). p2pd reads a throwaway key at its start,
    so its folder goes as soon as the DHT is up: a SIGKILL later leaves no file behind."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        identity_path, identity = load_identity(settings, Path(scratch))
        # behind relays, a DHT client: hivemind's routing tables hold our unreachable own addresses, so a DHT
        # server at home would lose the records stored with it and answer no reads
        return start_dht(settings, identity_path, relays=relays, client_mode=True if relays else None), identity


class InitialPeersUnreachable(ConfigError):
    """None of --initial-peers answered."""


def start_dht(
    settings: NetworkSettings,
    identity_path: Optional[Path] = None,
    *,
    client_mode: Optional[bool] = None,
    relays: Sequence[str] = (),
) -> hivemind.DHT:
    """Start hivemind's DHT process with the settings' addresses, identity and relay flags. Peers
    started together (a launcher, compose) pass --initial-peers-wait-s: until then, a start that no
    initial peer answers is tried again, after waiting for one of their TCP ports to accept."""
    deadline = time.monotonic() + settings.initial_peers_wait_s
    delay = 0.25
    while True:
        if settings.initial_peers_wait_s:
            _wait_for_a_port(settings.initial_peers, deadline)
        try:
            return _start_dht_once(settings, identity_path, client_mode=client_mode, relays=relays)
        except InitialPeersUnreachable:
            if time.monotonic() + delay >= deadline:
                raise
            logger.info(f"no initial peer answers yet; trying again for {deadline - time.monotonic():.0f} s more")
            time.sleep(delay)
            delay = min(2 * delay, 2.0)


def _wait_for_a_port(maddrs: list[str], deadline: float) -> None:
    """Until `deadline`, wait for one of `maddrs`' /ip4|ip6|dns/…/tcp/<port> to accept a TCP connection
    (a peer that is still starting refuses it): cheaper than starting a DHT that fails."""
    targets = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 4 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[3] == "tcp":
            targets.append((parts[2], int(parts[4])))
    said = False
    while targets and time.monotonic() < deadline:
        for host, port in targets:
            with suppress(OSError), socket.create_connection((host, port), timeout=0.5):
                return
        if not said:
            logger.info(f"waiting up to {deadline - time.monotonic():.0f} s for an initial peer to accept connections")
            said = True
        time.sleep(0.1)


def _start_dht_once(
    settings: NetworkSettings, identity_path: Optional[Path], *, client_mode: Optional[bool], relays: Sequence[str]
) -> hivemind.DHT:
    identity_path = identity_path or settings.identity_path
    if identity_path is not None and not identity_path.parent.is_dir():
        raise ConfigError(f"--identity-path: directory {str(identity_path.parent)!r} does not exist")
    check_listen_ports(settings)
    relay_kwargs, p2pd_flags = relay_flags(settings, relays)
    kwargs = dict(
        initial_peers=settings.initial_peers,
        host_maddrs=settings.listen_maddrs(),
        announce_maddrs=settings.announce() or None,
        identity_path=str(identity_path) if identity_path else None,
        # hivemind's duplicate-identity check reads RSA keys only; a throwaway key cannot be shared
        # (a restart behind relays keeps the identity it just had)
        check_if_identity_free=identity_path is not None and _is_rsa(identity_path) and not relays,
        use_relay=settings.use_relay,
        use_auto_relay=settings.use_auto_relay,
        nat_port_map=maps_ports(settings.listen_maddrs()),
        client_mode=settings.client_mode if client_mode is None else client_mode,
        start=True,
        await_ready=False,
    ) | relay_kwargs
    try:
        dht = _DHT(**kwargs, shutdown_timeout=3, p2pd_flags=p2pd_flags)
    except Exception as e:
        raise _explain(e, settings) from None
    deadline = time.monotonic() + 120
    while True:  # hivemind waits forever if its process dies before it is ready: poll instead
        try:
            dht.wait_until_ready(timeout=0.5)
            return dht
        except TimeoutError:
            if not dht.is_alive():
                raise PhalanxError("the DHT process died during start-up; run with --debug to see why") from None
            if time.monotonic() > deadline:
                dht.shutdown()
                raise PhalanxError("the DHT did not start within 120 s") from None
        except Exception as e:
            dht.shutdown()
            raise _explain(e, settings) from None


def _explain(e: Exception, settings: NetworkSettings) -> Exception:
    text = str(e)
    if "address already in use" in text.lower():
        flag = "--host-maddrs" if settings.host_maddrs else "--port"
        return ConfigError(f"{flag}: {settings.listen_maddrs()} is in use by another program; choose another port (0: any free one)")
    if "already taken" in text:
        return ConfigError(_identity_taken(settings.identity_path))
    if settings.initial_peers and ("bootstrap" in text.lower() or "failed to connect" in text.lower()):
        return InitialPeersUnreachable(
            f"--initial-peers: none of {', '.join(settings.initial_peers)} answered ({text.splitlines()[0][:200]}); "
            "check that the peer runs, that its port is reachable from here, and the address (copy it from "
            "`phalanx bootstrap`'s output)"
        )
    return e


def _identity_taken(path: Optional[Path]) -> str:
    holders = identity_holders(path) if path is not None else []
    if holders:
        daemon, dht, parent = holders[0]
        if parent <= 1 or _ppid(parent) is None:  # the DHT process outlived the peer that started it
            why = f"the orphaned DHT process {dht} and its p2p daemon {daemon}, left over from an earlier run that was killed"
            fix = f"`kill {dht} {daemon}`"
        else:
            why = f"the running peer with pid {parent} (DHT process {dht}, p2p daemon {daemon})"
            fix = f"`kill {parent}`"
        return f"--identity-path {path}: this identity is held by {why}; stop it with {fix}, or give this peer its own identity file"
    return (
        f"--identity-path {path}: a peer in the swarm already runs with this identity (a copy of this file elsewhere, "
        "or an earlier run still alive there); stop that peer, or give this one its own identity file"
    )


def identity_holders(path: Path) -> list[tuple[int, int, int]]:
    """(p2pd pid, its DHT process's pid, that one's parent pid) of every local p2p daemon started with
    this identity file (Linux /proc; empty elsewhere)."""
    target = path.resolve()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            ids = [a[4:].decode() for a in args if a.startswith(b"-id=")]
            if not ids or not args[0].endswith(b"p2pd"):
                continue
            cwd = (proc / "cwd").resolve()
            if any((cwd / i).resolve() == target for i in ids):
                dht = _ppid(int(proc.name)) or 0
                found.append((int(proc.name), dht, _ppid(dht) or 0))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def _ppid(pid: int) -> Optional[int]:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _is_rsa(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:2] == b"\x08\x00"


async def _get_visible_maddrs(_dht: hivemind.DHT, node: DHTNode) -> list[Multiaddr]:
    return await node.get_visible_maddrs()


async def _daemon_maddr(_dht: hivemind.DHT, node: DHTNode) -> Multiaddr:
    return node.p2p.daemon_listen_maddr


def socket_file(maddr: Multiaddr) -> Path:
    return Path(maddr.value_for_protocol("unix"))


async def daemon_socket_file(dht: hivemind.DHT) -> Path:
    """The unix socket file of the DHT's p2pd (see remove_if_stale)."""
    return socket_file(await in_dht(dht, _daemon_maddr))


async def replicate_p2p(dht: hivemind.DHT) -> P2P:
    """Our own client of the DHT's p2pd (hivemind's DHT.replicate_p2p blocks the loop on the DHT)."""
    return await P2P.replicate(await in_dht(dht, _daemon_maddr))


async def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in await in_dht(dht, _get_visible_maddrs)]


async def find_reachable(p2p: P2P, dht: hivemind.DHT, settings: NetworkSettings) -> bool:
    """Whether other peers can dial this one: an initial peer tries our libp2p port at the address our
    connection comes from. A peer that cannot be dialed (a home router, a firewall) leads no group and
    reduces no part: it sends its parts and takes the aggregates back over connections it opens itself.
    `--client-mode` says so without asking; a peer with no initial peer is a swarm's entry point."""
    if settings.client_mode:
        return False
    askers = [PeerID.from_base58(m.rsplit("/p2p/", 1)[1]) for m in settings.initial_peers if "/p2p/" in m]
    ports = [Multiaddr(m).value_for_protocol("tcp") for m in await visible_maddrs(dht) if "/tcp/" in m and "p2p-circuit" not in m]
    if not askers or not ports:
        return True
    answer = await dialable(p2p, askers, int(ports[0]))
    if answer is None:
        logger.warning("no initial peer answered whether it can dial this peer back; taking it as reachable")
        return True
    if not answer:
        logger.info(
            "other peers cannot dial this one (a home router or a firewall): it sends its parts and takes the "
            "aggregates over connections it opens, leads no group and reduces no part"
        )
    return answer


def relay_candidates(settings: NetworkSettings) -> list[str]:
    """The initial peers a peer nobody can dial reserves a relay slot on (none with --no-use-relay or
    --client-mode, which asks to dial out only)."""
    if not settings.use_relay or settings.client_mode:
        return []
    return [m for m in settings.initial_peers if "/p2p/" in m and "p2p-circuit" not in m]


async def direct_hosts(dht: hivemind.DHT, settings: NetworkSettings) -> tuple[str, list[str]]:
    """(listen host, announced hosts) for the direct TCP path, following the libp2p listen address."""
    listen = "0.0.0.0"
    first = Multiaddr(settings.listen_maddrs()[0])
    try:
        listen = first.value_for_protocol("ip4")
    except Exception:
        pass
    if settings.public_ip:
        return listen, [settings.public_ip]
    if listen not in ("0.0.0.0", ""):
        return listen, [listen]
    hosts = []
    for maddr in map(Multiaddr, await visible_maddrs(dht)):
        try:
            ip = maddr.value_for_protocol("ip4")
        except Exception:
            continue
        if ip not in hosts and "p2p-circuit" not in str(maddr):
            hosts.append(ip)
    return listen, hosts or ["127.0.0.1"]


async def serve_until(stop: asyncio.Event, dht: hivemind.DHT) -> None:
    """Return once `stop` is set; raise if the DHT process dies first, so that the process exits
    (and a supervisor such as docker-compose's restart policy starts it again) instead of
    lingering without a DHT."""
    while not stop.is_set():
        if not dht.is_alive():
            raise PhalanxError(f"{DHT_DIED}; stopping")
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            pass


def remove_if_stale(socket_file: Path) -> None:
    """Remove p2pd's socket file if nothing listens on it: the DHT process removes it when it stops
    p2pd, but not when it was killed first (then p2pd exits too and leaves the file in /tmp)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(socket_file))
        except ConnectionRefusedError:
            socket_file.unlink(missing_ok=True)
            logger.debug(f"removed {socket_file}, left by a daemon that was killed")
        except OSError:
            pass  # already gone, or not ours to judge


_DAEMON_CONNECTION_TASKS = ("ControlClient._read_from_persistent_conn", "ControlClient._write_to_persistent_conn")


def quiet_p2p_daemon_noise(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """A loop exception handler for two routine events that hivemind's daemon client leaves to
    asyncio, which logs each as an error with a traceback: p2pd opening a stream to us that the
    remote peer reset before it began, and the client's connection to p2pd failing because p2pd
    stopped first (Ctrl-C and killpg reach it too). One debug line each; all else as before."""
    error = context.get("exception")
    task = context.get("future")
    coro = getattr(task.get_coro(), "__qualname__", "") if isinstance(task, asyncio.Task) else ""
    routine = (ConnectionError, RuntimeError, asyncio.IncompleteReadError)
    if isinstance(error, routine) and coro in _DAEMON_CONNECTION_TASKS:
        logger.debug(f"the p2p daemon went away: {error!r}")
    elif isinstance(error, routine) and context.get("message") == "Unhandled exception in client_connected_cb":
        logger.debug(f"a p2p stream closed before it began: {error!r}")
    else:
        loop.default_exception_handler(context)


async def wait_for_trainers(node: Node, wanted: int, stop: Optional[asyncio.Event] = None, timeout_s: float = 60.0) -> int:
    """Wait (up to `timeout_s`, or until `stop` is set) until `wanted` trainers are announced, this one
    included; returns how many are, warning when fewer. The membership's own loop announces and reads the
    view; this only looks at it. (Reads of its own, each given up after 5 s, kept 32 trainers starting at
    once on 2 cores asking a DHT that answered none of them in time.)"""
    deadline = time.monotonic() + timeout_s
    while len(node.membership.peers()) < wanted and time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            break
        await asyncio.sleep(WAIT_READ_S)
    seen = len(node.membership.peers())
    if seen < wanted and not (stop is not None and stop.is_set()):
        logger.warning(f"starting with {seen} of the {wanted} peers asked for by --wait-for-peers")
    return seen


@dataclass(frozen=True)
class NodeSnapshot:
    """The node's counters at one instant. Only `Node.snapshot()` builds one; statistics(), the trainer's
    report and the health record, status and metrics all read it, so they agree on the numbers."""

    peer_id: str
    step: int = 0  # global steps of the state this peer holds
    state_version: str = ""  # hex of that state's version: equal at equal steps means the same model
    rounds: RoundCounts = RoundCounts()
    last_group_size: int = 0  # members of the last round that formed
    last_round_s: float = 0.0  # its matchmaking and all-reduce, wall clock
    # why members or parts were dropped: their bytes stopped (idle) or the deadline passed (late)
    members_dropped_idle: int = 0
    members_dropped_late: int = 0
    parts_dropped_idle: int = 0
    bytes_sent: int = 0  # by the round transport: payload and framing
    bytes_received: int = 0
    relayed_bytes: int = 0  # of those sent and received, to and from peers reached through a relay
    banned: tuple[str, ...] = ()  # sorted: peers the swarm banned, as this peer knows


@dataclass
class Node:
    dht: hivemind.DHT
    identity: Identity
    transport: Transport
    membership: Membership
    engine: RoundEngine
    redialer: Redialer
    keys: dict[str, DhtKey]  # the run's DHT keys, each with its validator installed (peer/dht_keys.py)
    relays: RelayKeeper
    hop: Optional[HopRelay] = None  # the relay this peer serves, if it is a swarm's entry point

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    def snapshot(self) -> NodeSnapshot:
        engine, rounds, transport = self.engine, self.engine.stats, self.transport.stats
        return NodeSnapshot(
            peer_id=self.peer_id,
            step=engine.step,
            state_version=engine.version.hex(),
            rounds=rounds.counts(),
            last_group_size=rounds.last_group_size,
            last_round_s=rounds.last_round_s,
            members_dropped_idle=rounds.members_dropped_idle,
            members_dropped_late=rounds.members_dropped_late,
            parts_dropped_idle=rounds.parts_dropped_idle,
            bytes_sent=transport.bytes_sent,
            bytes_received=transport.bytes_received,
            relayed_bytes=transport.relayed_bytes,
            banned=tuple(sorted(self.membership.banned)),
        )

    async def aclose(self) -> None:
        alive = self.dht.is_alive()  # a Ctrl-C or killpg may have taken the DHT and p2pd down already
        if alive:
            try:  # a round joined early: our part and reduction, so its members do not wait for them
                await asyncio.wait_for(self.engine.leave(), timeout=LEAVE_ROUND_S)
            except Exception as e:
                logger.debug(f"leaving the round joined early failed: {e!r}")
        steps = (
            self.relays.aclose(),
            *([self.hop.aclose()] if self.hop is not None else []),
            self.redialer.aclose(),
            self.engine.aclose(),
            self.membership.aclose(announce_leaving=alive),
            self.transport.aclose(),
        )
        for step in steps:
            try:
                await asyncio.wait_for(step, timeout=2)
            except Exception as e:
                logger.debug(f"shutdown step failed: {e!r}")
        await self.transport.p2p.shutdown()  # our replica's connection to p2pd, and its socket file in /tmp
        await asyncio.get_running_loop().run_in_executor(None, self.dht.shutdown)
        remove_if_stale(socket_file(self.transport.p2p.daemon_listen_maddr))


class _Phases:
    """Logs (--debug) how long each phase of a node's start took: start-up time is spent here at scale."""

    def __init__(self) -> None:
        self.began = self.last = time.monotonic()

    def done(self, phase: str) -> None:
        now = time.monotonic()
        logger.debug(f"start-up: {phase} after {now - self.last:.2f} s ({now - self.began:.2f} s in all)")
        self.last = now


async def open_node(plan: PeerPlan, *, loss: Callable[[], Optional[float]] = lambda: None) -> Node:
    """Start the DHT and everything a trainer's rounds need, as `plan` says; close with `Node.aclose`."""
    config = plan.network
    loop = asyncio.get_running_loop()
    phases = _Phases()
    dht, identity = await loop.run_in_executor(None, start_dht_as, config, "phalanx-peer-")
    phases.done("DHT process and p2pd up")
    try:
        p2p = await replicate_p2p(dht)
        reachable = await find_reachable(p2p, dht, config)
        phases.done("reachability known")
        relays = relay_candidates(config) if not reachable else []
        if relays:  # p2pd takes relays at its start only: start again, reserving a slot on each
            await p2p.shutdown()
            await loop.run_in_executor(None, dht.shutdown)
            dht, identity = await loop.run_in_executor(None, start_dht_as, config, "phalanx-peer-", relays)
            p2p = await replicate_p2p(dht)
        key = plan.run_key
        owner = load_owner_public(plan.private.owner_key) if plan.private is not None else None
        keys = run_keys(config.run_id, key, owner)
        await install(dht, keys)
        phases.done("record validators installed")
        gate = None
        if plan.private is not None:
            gate = AdmissionGate(dht, keys["certs"].name, owner, config.run_id, identity.peer_id, plan.private.certificate.read_bytes())
            try:
                await gate.start()
            except PeerProtocolError as e:
                raise ConfigError(f"--certificate: {e} (ask the owner for a certificate of {identity.peer_id})") from None
        listen, hosts = await direct_hosts(dht, config)
        phases.done("data-port hosts known")
        await DialBackService.open(p2p, admission=gate)  # `phalanx doctor` of other peers asks us to dial their data port
        hop = await serve_relay(p2p, config)
        banned: set[str] = set()  # one set: the transport refuses their calls, membership hides them, bans add to it
        transport = await Transport.open(
            p2p,
            namespace=key,
            direct_host=listen if config.direct and reachable else None,  # nobody could connect to a data port
            direct_port=config.direct_port,
            announce_hosts=hosts,
            upload_limit_bytes_per_s=config.upload_limit_mbps * 1e6 / 8,
            admission=gate,
            banned=banned,
        )
        leader_period_s = LEADER_PERIOD_S if plan.round.verify is not None else None
        membership = Membership(
            dht, keys["peers"].name, transport.peer_id, identity=identity, leader_period_s=leader_period_s,
            admitted=gate.knows if gate is not None else None, reachable=reachable, banned=banned,
        )  # fmt: skip
        bans = BanBook(dht, keys["bans"].name, banned)
        engine = RoundEngine(
            transport, membership, plan.round, plan.run_hash, identity=identity, bans=bans,
            behavior=plan.attack.behavior, sync_policy=plan.sync_policy, loss=loss,
        )  # fmt: skip
        keeper = RelayKeeper(transport, membership, relays)
        await keeper.tick()  # the first record names its circuits already
        phases.done("transport open")
        await membership.start()
        phases.done("first membership refresh")
        await keeper.tick()  # and relayed peers in view are dialed before the first join
        await keeper.start()
        await engine.start()
        if transport.peer_id != identity.peer_id:
            raise PhalanxError(f"the daemon runs as {transport.peer_id}, not as the identity file's {identity.peer_id}")
        redialer = Redialer(dht, transport.peer_id, config.initial_peers, watch=partial(_membership_view, membership))
        await redialer.start()
        phases.done("node open")
    except BaseException:
        dht.shutdown()
        raise
    return Node(dht, identity, transport, membership, engine, redialer, keys, keeper, hop)


def _membership_view(membership: Membership) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """(trainers in view, trainers that announced leaving) for the redialer; p2pd knows their addresses."""
    return {p: () for p in membership.peers()}, list(membership.peers(states=("leaving",)))
