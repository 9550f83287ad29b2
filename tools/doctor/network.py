"""Checks over the network, from a p2pd of our own (no DHT process): the daemon starts, each initial
peer answers TCP, the libp2p handshake and a DHT ping (whose reply carries the peer's clock), and
a reached peer can dial this one back (AutoNAT)."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from phalanx.peer.config import PeerConfig
from phalanx.peer.ports import maps_ports
from phalanx.tools.doctor import autonat
from phalanx.tools.doctor.local import BOOTSTRAP_LINE, host_port, peer_id_of, short
from phalanx.tools.doctor.rows import Row, failed, ok, skipped, warned

P2PD_STARTUP_TIMEOUT_S = 15.0  # hivemind's default, which `phalanx join` runs with
TCP_TIMEOUT_S = 5.0
HANDSHAKE_TIMEOUT_S = 10.0
PING_TIMEOUT_S = 5.0
DIAL_BACK_TIMEOUT_S = 30.0  # the peer's AutoNAT dial itself may take up to ~15 s
MAX_PEERS_PINGED = 16  # peers in view whose clocks are compared


@dataclass
class Probe:
    """What we learned of one peer."""

    peer_id: str
    maddrs: list[str]
    reached: bool = False  # libp2p handshake done
    rtt_s: Optional[float] = None  # DHT ping round trip
    offset_s: Optional[float] = None  # its clock minus ours (midpoint of the ping)
    rows: list[Row] = field(default_factory=list)


async def start_daemon(settings: PeerConfig):
    """(P2P or None, row): a p2pd with the peer's listen, announce and relay flags, timed."""
    from hivemind.p2p import P2P

    started = time.monotonic()
    try:
        p2p = await P2P.create(
            host_maddrs=settings.listen_maddrs(),
            announce_maddrs=settings.announce() or None,
            use_relay=settings.use_relay,
            use_auto_relay=settings.use_auto_relay,
            nat_port_map=maps_ports(settings.listen_maddrs()),
            startup_timeout=P2PD_STARTUP_TIMEOUT_S,
        )
    except Exception as e:
        return None, failed("p2p daemon", first_line(e), _daemon_fix(str(e)))
    return p2p, ok("p2p daemon", f"p2pd started in {time.monotonic() - started:.1f} s (limit {P2PD_STARTUP_TIMEOUT_S:.0f} s)")


def _daemon_fix(text: str) -> str:
    lowered = text.lower()
    if "address already in use" in lowered:
        return "another process holds the libp2p port: pick another --port / --host-maddrs (0: any free port)"
    if "failed to start in" in lowered:
        return "p2pd printed nothing in time: the machine may be overloaded, or something blocks p2pd; rerun with --debug for its log"
    if "not found" in lowered or "format" in lowered:
        return "hivemind's p2pd binary is missing or unusable here: reinstall hivemind (pip install --force-reinstall hivemind)"
    if "announce" in lowered or "multiaddr" in lowered:
        return "check --host-maddrs / --announce-maddrs (explicit ports, addresses of this machine)"
    return "rerun with --debug to see p2pd's log"


def first_line(e: BaseException) -> str:
    text = (str(e) or type(e).__name__).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


async def probe_initial_peer(p2p, addr: str) -> Probe:
    """TCP connect, then the libp2p handshake, then a DHT ping; later stages are skipped (loudly)
    when an earlier one fails."""
    from hivemind.utils.multiaddr import Multiaddr

    peer = peer_id_of(addr) or ""
    probe = Probe(peer, [addr])
    maddr = Multiaddr(addr)
    name = f"initial peer {short(peer)}"
    where = host_port(maddr)
    host, _, port = where.rpartition(":")
    if "/tcp/" not in addr:
        probe.rows.append(skipped(f"{name}: tcp", "a UDP (QUIC) address: only the libp2p handshake can tell"))
    elif not await _tcp(probe, where, host, port, name):
        return probe
    if not await _handshake(p2p, probe, maddr, name):
        probe.rows.append(skipped(f"{name}: dht ping", "no libp2p connection"))
        return probe
    probe.rows.append(await ping_row(p2p, probe, name))
    return probe


async def _tcp(probe: Probe, where: str, host: str, port: str, name: str) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), TCP_TIMEOUT_S)
        writer.close()
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        reason = "timed out" if isinstance(e, asyncio.TimeoutError) else (getattr(e, "strerror", None) or first_line(e))
        probe.rows.append(failed(f"{name}: tcp", f"cannot connect to {where}: {reason}", f"is the peer running there and its port open to you? {BOOTSTRAP_LINE} (it names the right host and port)"))
        probe.rows += [skipped(f"{name}: libp2p", "no TCP connection"), skipped(f"{name}: dht ping", "no TCP connection")]
        return False
    probe.rows.append(ok(f"{name}: tcp", f"{where} accepts connections"))
    return True


async def _handshake(p2p, probe: Probe, maddr, name: str) -> bool:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    started = time.monotonic()
    try:
        transport = Multiaddr(str(maddr).rsplit("/p2p/", 1)[0])
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(probe.peer_id), [transport]), HANDSHAKE_TIMEOUT_S)
    except Exception as e:
        text = first_line(e) if not isinstance(e, asyncio.TimeoutError) else f"no answer in {HANDSHAKE_TIMEOUT_S:.0f} s"
        if "peer id mismatch" in text.lower() or "remote key matches" in text.lower():
            fix = f"another peer answers at this address (restarted without --identity-path?): {BOOTSTRAP_LINE} again"
        else:
            fix = "the port answers TCP but not libp2p: is it a phalanx/hivemind peer's libp2p port (not its --http-port or --direct-port)?"
        probe.rows.append(failed(f"{name}: libp2p", text, fix))
        return False
    probe.reached = True
    probe.rows.append(ok(f"{name}: libp2p", f"handshake with {short(probe.peer_id)} in {time.monotonic() - started:.2f} s"))
    return True


async def ping(p2p, peer_id: str) -> tuple[float, float]:
    """(round trip s, offset s) from one DHT ping: the reply carries the peer's DHT time."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(), validate=False)  # empty node info: not added to its table
    sent = time.time()
    reply = await asyncio.wait_for(
        p2p.call_protobuf_handler(PeerID.from_base58(peer_id), "DHTProtocol.rpc_ping", request, dht_pb2.PingResponse),
        PING_TIMEOUT_S,
    )
    received = time.time()
    if not math.isfinite(reply.dht_time) or not 0 < reply.dht_time < 1e11:  # unset, NaN or absurd
        raise ValueError("the reply carries no usable time")
    return received - sent, reply.dht_time - (sent + received) / 2


async def ping_row(p2p, probe: Probe, name: str) -> Row:
    try:
        probe.rtt_s, probe.offset_s = await ping(p2p, probe.peer_id)
    except Exception as e:
        text = first_line(e) if not isinstance(e, asyncio.TimeoutError) else f"no answer in {PING_TIMEOUT_S:.0f} s"
        return failed(f"{name}: dht ping", text, "the peer speaks libp2p but serves no DHT: give the address of a `phalanx bootstrap` or `phalanx join` peer")
    return ok(f"{name}: dht ping", f"answered in {probe.rtt_s * 1000:.0f} ms")


def reached_row(probes: list[Probe], given: int) -> Row:
    """With several initial peers, one reachable is enough to join."""
    reached = [p for p in probes if p.rtt_s is not None]
    if not given:
        return failed("initial peers", "none given: this peer would train alone", f"pass --initial-peers: {BOOTSTRAP_LINE}")
    if not reached:
        return failed("initial peers", f"none of the {given} answered a DHT ping", "see the rows above; a peer must be running and reachable from here")
    return ok("initial peers", f"{len(reached)} of {given} reachable")


def _is_private(addr: str) -> bool:
    parts = addr.split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts:
            try:
                return not ipaddress.ip_address(parts[parts.index(proto) + 1]).is_global
            except ValueError:
                return False
    return False  # a DNS name: assume it is meant to be public


async def guarded(check: str, step) -> Optional[Row]:
    """`await step`, or a fail row carrying the error: an unexpected answer is a finding, not a crash."""
    try:
        return await step
    except Exception as e:
        return failed(check, f"could not be checked: {first_line(e)}", "rerun with --debug for the details")


async def reachability_row(p2p, settings: PeerConfig, probes: list[Probe]) -> Row:
    """Can peers outside reach this one? Asks a reached peer's AutoNAT service to dial us back."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    check = "reachable from outside"
    if settings.client_mode:
        return ok(check, "--client-mode: this peer only dials out, others never need to reach it")
    own = [Multiaddr(str(m).rsplit("/p2p/", 1)[0]) for m in await p2p.get_visible_maddrs(latest=True)]
    relayed = [str(m) for m in own if "p2p-circuit" in str(m)]
    reached = [p for p in probes if p.reached]
    if not reached:
        return skipped(check, "no initial peer reached to dial us back")
    target = reached[0]
    try:
        answer = await autonat.request_dial_back(p2p, PeerID.from_base58(target.peer_id), [m.to_bytes() for m in own], timeout_s=DIAL_BACK_TIMEOUT_S)
    except Exception as e:
        return warned(check, f"{short(target.peer_id)} could not be asked to dial back ({first_line(e)})", "try another --initial-peers; if peers cannot reach you, use --use-auto-relay or --client-mode")
    if answer.status == autonat.OK:
        try:
            seen = str(Multiaddr(answer.addr))
        except Exception:  # absent, or not a multiaddr: the verdict stands without it
            seen = "an address of ours"
        return ok(check, f"public: {short(target.peer_id)} dialed back {seen}")
    if answer.status == autonat.E_DIAL_REFUSED and all(_is_private(a) for a in target.maddrs):
        return ok(check, f"local network: {short(target.peer_id)} is on a private address, as this peer is; a dial-back from outside does not apply")
    if relayed:
        return ok(check, f"relayed: {short(target.peer_id)} could not dial us directly, peers reach us through {relayed[0]}")
    listed = ", ".join(str(m) for m in own) or "none"
    if answer.status == autonat.E_DIAL_ERROR and settings.use_relay:
        relays = ", ".join(short(m.rsplit("/p2p/", 1)[1]) for m in settings.initial_peers if "/p2p/" in m)
        return warned(
            check,
            f"not directly: {short(target.peer_id)} could not dial back any of {listed}. Rounds: this peer opens "
            f"its connections itself and reduces no part while a trainer others can dial is in its group; other "
            f"trainers reach it through a relay slot on {relays} (the reach column of `phalanx health` says relay)",
            "nothing to do; for direct rounds forward --port and pass --public-ip",
        )
    if answer.status == autonat.E_DIAL_ERROR:
        return failed(check, f"unreachable: {short(target.peer_id)} could not dial back any of {listed}, and --no-use-relay leaves no way in", "drop --no-use-relay, or forward --port and pass --public-ip")
    status = autonat.STATUS_NAMES.get(answer.status, str(answer.status))
    return warned(check, f"{short(target.peer_id)} would not dial back ({status}: {answer.text})", "if peers cannot reach you, use --use-auto-relay or --client-mode")


async def ping_more(p2p, probes: list[Probe], addresses: dict[str, list[str]]) -> None:
    """Ping peers seen in health records too (their clocks count as much as the initial peers')."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    known = {p.peer_id for p in probes}
    for peer, maddrs in list(addresses.items())[:MAX_PEERS_PINGED]:
        if peer in known or peer == p2p.peer_id.to_base58():
            continue
        probe = Probe(peer, maddrs)
        try:
            transports = [Multiaddr(m.split("/p2p/")[0]) for m in maddrs if "p2p-circuit" not in m]
            await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), transports), HANDSHAKE_TIMEOUT_S)
            probe.reached = True
            probe.rtt_s, probe.offset_s = await ping(p2p, peer)
        except Exception:
            pass  # a peer in view we cannot reach is the health table's business; the clock row says how many answered
        probes.append(probe)


async def identity_free_row(p2p, settings: PeerConfig, probes: list[Probe]) -> Optional[Row]:
    """Is another live peer (often the orphaned DHT process of a killed run) using our identity file?
    hivemind refuses to start then; this names the cause. None without --identity-path."""
    from hivemind.p2p import PeerID

    check = "identity free"
    path = settings.identity_path
    if path is None or not path.is_file():
        return None
    from phalanx.errors import ConfigError
    from phalanx.security.identity import Identity

    try:
        peer_id = PeerID.from_base58(Identity.load(path).peer_id)
    except ConfigError:
        return skipped(check, "the identity file is unreadable (see its row)")
    if not any(p.reached for p in probes):
        return skipped(check, "no initial peer reached to look for its peer ID")
    try:  # as hivemind's own check does: the daemon looks the peer ID up through the peers it knows
        await asyncio.wait_for(p2p._client.connect(peer_id, []), HANDSHAKE_TIMEOUT_S)
    except Exception:
        return ok(check, f"no live peer of the swarm runs as {short(peer_id.to_base58())}")
    return failed(check, f"a live peer already runs as {peer_id.to_base58()} (this file's ID)", "stop that peer first (after a kill -9, its DHT process and p2pd may still run: find them with `ps -ef | grep p2pd`), or give this one its own --identity-path")


async def direct_port_row(p2p, settings: PeerConfig, probes: list[Probe]) -> Row:
    """Can peers open TCP to this peer's direct data port? A reached peer dials it back (protocol/dial_back.py)
    while we listen on it for the nonce we chose."""
    import secrets
    import socket

    from hivemind.p2p import PeerID

    from phalanx.protocol import dial_back
    from phalanx.tools.doctor.local import listen_host

    check = "direct data port from outside"
    if not settings.direct:
        return ok(check, "--no-direct: bulk tensor bytes take libp2p streams")
    if settings.client_mode:
        return ok(check, "--client-mode: this peer only dials out; peers that cannot reach its data port use libp2p streams")
    reached = [p for p in probes if p.reached]
    if not reached:
        return skipped(check, "no initial peer reached to dial us back")
    try:
        listener = socket.create_server((listen_host(settings), settings.direct_port))
    except OSError:
        return skipped(check, f"cannot listen on --direct-port {settings.direct_port} (see the direct data port row)")
    port = listener.getsockname()[1]
    which = f"--direct-port {port}" if settings.direct_port else f"port {port} (any free one, as --direct-port 0 picks)"
    nonce = secrets.token_bytes(dial_back.NONCE_BYTES)
    arrived = asyncio.Event()

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(dial_back.CONNECT_TIMEOUT_S):
                if await reader.readexactly(len(dial_back.MAGIC) + len(nonce)) == dial_back.MAGIC + nonce:
                    arrived.set()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(take, sock=listener)
    target = reached[0]
    fix = (f"open TCP {which} in this machine's firewall (and forward it on the router, with --public-ip), "
           "or pass --no-direct: bulk bytes then take libp2p streams, which are slower")  # fmt: skip
    answer = None
    try:
        answer = await dial_back.request_dial_back(p2p, PeerID.from_base58(target.peer_id), port, nonce, DIAL_BACK_TIMEOUT_S)
        if answer.reached:
            await asyncio.wait_for(arrived.wait(), dial_back.CONNECT_TIMEOUT_S)
    except TimeoutError:
        if answer is not None:
            return failed(check, f"{short(target.peer_id)} connected to {answer.address}, but not to this peer", f"something else answers there (a port forward to another machine?): {fix}")
        return warned(check, f"{short(target.peer_id)} did not answer the dial-back request in {DIAL_BACK_TIMEOUT_S:g} s", "try again, or another --initial-peers")
    except Exception as e:
        return warned(check, f"{short(target.peer_id)} could not be asked to dial back ({first_line(e)}; an older phalanx?)", "try another --initial-peers")
    finally:
        server.close()
        await server.wait_closed()
    if answer.reached:
        return ok(check, f"{short(target.peer_id)} connected to {which} at {answer.address}")
    return failed(check, f"{short(target.peer_id)} could not connect to {which} at {answer.address or 'your address'}: {answer.error}", fix)
