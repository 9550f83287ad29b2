"""Listen ports and addresses before the DHT starts. A busy port is refused: p2pd listens with
SO_REUSEPORT, so a second peer on a port another peer holds would start and share it (printing an
address that reaches either peer), and a port held by another program fails deep inside the daemon
with a long traceback. A peer on loopback only asks no router for a port mapping."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

from multiaddr import Multiaddr

from phalanx.errors import ConfigError


def check_port_free(flag: str, host: str, port: int) -> None:
    """ConfigError naming `flag` unless this process could listen on host:port now (0: any port, always free)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed peer's TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
            probe.listen()
        except OSError as e:
            raise ConfigError(
                f"{flag}: cannot listen on {host}:{port} ({e.strerror or e}); another program or phalanx peer "
                "holds it: stop it, or choose another port (0: any free one)"
            ) from None


def check_listen_ports(settings) -> None:
    """Every fixed TCP port in the settings (libp2p listen addresses, the direct tensor port) is free."""
    flag = "--host-maddrs" if settings.host_maddrs else "--port"
    hosts = []
    for text in settings.listen_maddrs():
        maddr = Multiaddr(text)
        names = {p.name for p in maddr.protocols()}
        if "tcp" not in names or not ({"ip4", "ip6"} & names):
            continue
        host = maddr.value_for_protocol("ip4" if "ip4" in names else "ip6")
        hosts.append(host)
        check_port_free(flag, host, int(maddr.value_for_protocol("tcp")))
    if getattr(settings, "direct", False) and settings.direct_port:
        if settings.direct_port == settings.port:
            raise ConfigError(f"--direct-port {settings.direct_port} is also --port; give them different ports")
        check_port_free("--direct-port", hosts[0] if hosts and "." in hosts[0] else "0.0.0.0", settings.direct_port)


def maps_ports(maddrs: Sequence[str]) -> bool:
    """Whether p2pd should ask the router to forward its port (UPnP, NAT-PMP): not when it listens on loopback
    only (local swarms, tests), where nothing could be forwarded and the router search would multicast
    on the machine's LAN and write to its gateway. No address at all: nothing to forward either."""
    for text in maddrs:
        parts = text.split("/")
        if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
            return True
        try:
            if not ipaddress.ip_address(parts[2]).is_loopback:
                return True
        except ValueError:
            return True
    return False
