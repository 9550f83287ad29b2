"""PeerMetrics: what the training loop reports (throughput, rounds, sync state)."""

from __future__ import annotations

import pytest

from phalanx.peer.health.metrics import PeerMetrics
from phalanx.protocol.allreduce import AllReduceResult
from phalanx.protocol.engine import Averaged, Resync
from phalanx.protocol.matchmaking import GroupSpec

A, B = "QmAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "QmBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
GROUP = GroupSpec(round_id=b"r" * 16, members=[A, B], step=0, version=b"v", donations=[])


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def averaged(missing: tuple[int, ...] = ()) -> Averaged:
    result = AllReduceResult.__new__(AllReduceResult)
    object.__setattr__(result, "missing_parts", missing)
    object.__setattr__(result, "dropped_senders", ())
    return Averaged(GROUP, result)


def test_rounds_update_step_loss_throughput_and_sync():
    clock = Clock()
    m = PeerMetrics(role="trainer", clock=clock, wall_clock=lambda: 1000.0)
    assert not m.in_sync and m.samples_per_s == 0
    m.round_done(step=1, loss=2.0, samples=32, averaged=averaged(), duration_s=0.1)
    assert m.in_sync and m.step == 1 and m.samples_per_s == 0  # the first round has no interval yet
    clock.t = 0.5
    m.round_done(step=2, loss=1.0, samples=32, averaged=averaged(missing=(1,)), duration_s=0.2)
    assert m.samples_per_s == pytest.approx(64.0)
    assert m.last_round.outcome == "partial" and m.last_round.members == [A, B] and m.last_round.finished_at == 1000.0
    samples = {s.name: s.value for s in m.round_seconds.collect()[0].samples}
    assert samples["phalanx_round_duration_seconds_count"] == 2
    assert samples["phalanx_round_duration_seconds_sum"] == pytest.approx(0.3)


def test_resync_marks_the_peer_out_of_sync_until_a_round_completes():
    m = PeerMetrics(role="trainer", clock=Clock())
    m.round_done(step=1, loss=1.0, samples=32, averaged=averaged(), duration_s=0.1)
    m.resync_started(Resync(GROUP, B))
    assert not m.in_sync and m.last_round.outcome == "resync"
    m.resynced(7)
    assert m.step == 7 and not m.in_sync
    m.round_done(step=8, loss=1.0, samples=32, averaged=averaged(), duration_s=0.1)
    assert m.in_sync
