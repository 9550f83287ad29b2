"""Hole punching between homes, with the p2pd flags phalanx gives a home (`peer.node.relay_flags`).

libp2p punches a hole (DCUtR) between two homes connected through a relay once each knows its public
address, which identify accepts after 4 peers observed it. So this lab has public-looking addresses,
a relay and 3 more public peers, and stealth routers (a router that refuses an unexpected SYN, rather
than dropping it, kills the simultaneous open when the other half comes a moment late). Behind
routers that keep a connection's port, home B's relayed connection to home A gains a direct one;
behind symmetric NAT (a random port per connection) it stays relayed, and calls still go through.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import hivemind
import pytest
from hivemind.p2p import P2P
from hivemind.proto import test_pb2
from multiaddr import Multiaddr

from phalanx.peer.config import NetworkSettings
from phalanx.peer.node import relay_flags
from phalanx.security.identity import Identity
from phalanx.tools.lab.hosts import PUBLIC_LOOKING_SUBNET, Lab

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

P2PD = Path(hivemind.__file__).parent / "hivemind_cli" / "p2pd"
PORT = 4101
PUBLIC = ("relay", "o1", "o2", "o3")  # the relay and the other observers of each home's address
DIRECT_WITHIN_S = 20.0  # per relayed connection
ATTEMPTS = {False: 4, True: 2}  # relayed connections B opens to A, one after another, by symmetric


def _p2pd_flags(create: dict, extra: dict) -> list[str]:
    """p2pd's flags for relay_flags' P2P.create arguments and extra flags, as hivemind renders them."""
    kwargs = dict(P2P.FORCE_REACHABILITY_MAPPING.get(create.get("force_reachability"), {}))
    if create.get("use_auto_relay"):
        kwargs["autoRelay"] = True
    if create.get("trusted_relays"):
        kwargs["trustedRelays"] = ",".join(create["trusted_relays"])
    return P2P._make_process_args(**kwargs, **extra)


def _start(host, tmp: Path, name: str, args: list[str]) -> Path:
    sock = tmp / f"{name}.sock"
    log = open(tmp / f"{name}.log", "wb")
    host.popen([str(P2PD), f"-listen=/unix{sock}", "-dht", "-autonat", *args], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return sock


async def _replica(sock: Path) -> P2P:
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert time.monotonic() < deadline, f"p2pd never opened {sock}"
        await asyncio.sleep(0.1)
    return await P2P.replicate(Multiaddr(f"/unix{sock}"))


async def _addresses_of(p2p: P2P, peer) -> list[str]:
    return [str(a) for info in await p2p.list_peers() if info.peer_id == peer for a in info.addrs]


async def _connected_to(p2p: P2P, relay_id: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not any(info.peer_id.to_base58() == relay_id for info in await p2p.list_peers()):
        assert time.monotonic() < deadline, f"{p2p.peer_id} never connected to the relay"
        await asyncio.sleep(0.5)


async def _relayed_call(a: P2P, b: P2P, circuit: Multiaddr, number: int) -> None:
    # both homes on the relay before B's first dial: a dial that fails (A had no slot yet) puts the
    # circuit in libp2p's dial backoff (6 s, then 9, 14, 21, ...), and CI once ran out of its 30 s so
    relay_id = str(circuit).split("/p2p/")[1].split("/")[0]
    await _connected_to(a, relay_id)
    await _connected_to(b, relay_id)
    deadline = time.monotonic() + 60
    while True:  # until A holds its slot on the relay
        try:
            await b._client.connect(a.peer_id, [circuit])
            break
        except Exception:
            assert time.monotonic() < deadline, "B never reached A through the relay"
            await asyncio.sleep(0.5)
    reply = await b.call_protobuf_handler(a.peer_id, "echo", test_pb2.TestRequest(number=number), test_pb2.TestRequest)
    assert reply.number == number


async def _scenario(lab: Lab, tmp: Path, attempts: int) -> tuple[int | None, float]:
    """(the relayed connection that became direct, if one did; seconds since the first relayed call)."""
    observers = []
    for name in PUBLIC:
        identity = Identity.generate_ed25519(tmp / f"{name}.id")
        host = lab[name]
        create, extra = (
            relay_flags(NetworkSettings(relay_budget_gb=1))
            if name == "relay"
            else (dict(force_reachability="public"), {})
        )
        args = [f"-id={tmp / f'{name}.id'}", f"-hostAddrs=/ip4/{host.ip}/tcp/{PORT}", *_p2pd_flags(create, extra)]
        _start(host, tmp, name, args)
        observers.append(f"/ip4/{host.ip}/tcp/{PORT}/p2p/{identity.peer_id}")
    relay = observers[0]
    create, extra = relay_flags(NetworkSettings(initial_peers=[relay]), [relay])
    home_args = [f"-bootstrapPeers={','.join(observers)}", "-b", *_p2pd_flags(create, extra)]
    socks = {
        name: _start(lab[name], tmp, name, [f"-hostAddrs=/ip4/0.0.0.0/tcp/{PORT}", *home_args]) for name in ("a", "b")
    }
    a, b = await _replica(socks["a"]), await _replica(socks["b"])
    try:

        async def echo(request, _context):
            return request

        await a.add_protobuf_handler("echo", echo, test_pb2.TestRequest)
        circuit = Multiaddr(f"{relay}/p2p-circuit/p2p/{a.peer_id.to_base58()}")
        began = time.monotonic()
        for attempt in range(1, attempts + 1):
            # libp2p punches once per relayed connection, and only once the home counts its public
            # address as confirmed; a home that reconnects through the relay gets another punch
            await _relayed_call(a, b, circuit, number=attempt)
            waited = time.monotonic()
            while time.monotonic() - waited < DIRECT_WITHIN_S:
                if any("p2p-circuit" not in address for address in await _addresses_of(b, a.peer_id)):
                    return attempt, time.monotonic() - began
                await asyncio.sleep(0.5)
            reply = await b.call_protobuf_handler(
                a.peer_id, "echo", test_pb2.TestRequest(number=100 + attempt), test_pb2.TestRequest
            )
            assert reply.number == 100 + attempt  # still through the relay
            await b._client.disconnect(a.peer_id)
        return None, time.monotonic() - began
    finally:
        for p2p in (a, b):
            await p2p.shutdown()


@pytest.mark.parametrize("symmetric", [False, True], ids=["port-keeping NAT", "symmetric NAT"])
def test_homes_punch_a_hole_where_both_nats_allow_it(lab_machine, tmp_path, symmetric):
    with Lab(list(PUBLIC), tag="hp", subnet=PUBLIC_LOOKING_SUBNET) as lab:
        for home in ("a", "b"):
            lab.add_home(home, symmetric=symmetric, stealth=True)
        direct, after_s = asyncio.run(_scenario(lab, tmp_path, ATTEMPTS[symmetric]))
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-800:]}" for p in sorted(tmp_path.glob("*.log")))
    if symmetric:
        assert direct is None, f"a hole through symmetric NAT?\n{logs}"
        print(
            f"symmetric NAT: {ATTEMPTS[symmetric]} relayed connections, still relayed {after_s:.0f} s after the first call"
        )
    else:
        assert direct is not None, (
            f"no direct connection in {ATTEMPTS[symmetric]} relayed connections of {DIRECT_WITHIN_S:.0f} s\n{logs}"
        )
        print(
            f"port-keeping NAT: relayed connection {direct} of B to A direct {after_s:.1f} s after the first relayed call"
        )
