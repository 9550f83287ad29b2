"""The dial-back service's input checks and whom it dials: only the asker's own observed address."""

import asyncio

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo
from hivemind.utils.multiaddr import Multiaddr

from phalanx.aggregation.errors import PeerProtocolError
from phalanx.protocol.dial_back import DialBackRequest, observed_host
from phalanx.security.wire import pack, unpack

ASKER = PeerID.from_base58("12D3KooWD2XqoBLqVUdzF3AGJudaRZg9NNrpxRnvhMDWD3BTdPQN")
OTHER = PeerID.from_base58("QmSzgc5qC2Ca4XD8gzVqgDKSvnndGBbUzMHRVexprAdrtK")


@pytest.mark.parametrize("port, nonce", [(0, b"n" * 16), (65536, b"n" * 16), (80, b"short"), (80, b"n" * 17)])
def test_requests_out_of_range_are_refused(port, nonce):
    raw = pack(DialBackRequest.model_construct(port=port, nonce=nonce))
    with pytest.raises(PeerProtocolError):
        unpack(raw, DialBackRequest, peer="x")


class _P2P:
    def __init__(self, infos):
        self.infos = infos

    async def list_peers(self):
        return self.infos


@pytest.mark.parametrize(
    "addrs, host",
    [
        (["/ip4/10.77.0.2/tcp/4001"], "10.77.0.2"),
        (["/ip4/203.0.113.9/tcp/4001/p2p/QmSzgc5qC2Ca4XD8gzVqgDKSvnndGBbUzMHRVexprAdrtK/p2p-circuit", "/ip6/::1/tcp/5"], "::1"),
        (["/ip4/203.0.113.9/tcp/4001/p2p/QmSzgc5qC2Ca4XD8gzVqgDKSvnndGBbUzMHRVexprAdrtK/p2p-circuit"], None),  # relayed only
    ],
)
def test_the_host_dialed_is_the_askers_own_connection_address(addrs, host):
    infos = [PeerInfo(OTHER, [Multiaddr("/ip4/198.51.100.1/tcp/1")]), PeerInfo(ASKER, [Multiaddr(a) for a in addrs])]
    assert asyncio.run(observed_host(_P2P(infos), ASKER)) == host
    assert asyncio.run(observed_host(_P2P(infos[:1]), ASKER)) is None  # not connected to us: nothing to dial
