"""`phalanx bench allreduce --verify` end to end on a small vector: real peers, every case, uploads capped."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from phalanx.protocol.channel import RECORD_BYTES
from phalanx.tools.bench.allreduce import VERIFY_CASES, run_verify_bench

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_verify_bench_runs_every_case_and_honours_the_upload_cap(monkeypatch):
    # uncapped (0) differs only in passing no --upload-mbps: `phalanx bench allreduce --verify` runs both
    monkeypatch.setattr("os.cpu_count", lambda: 1)  # the peers share fewer cores than there are peers: said so
    out = io.StringIO()
    numel, cap_mbps = 1_000_000, 200.0
    rows = run_verify_bench([2], numel, 1, (cap_mbps,), console=Console(file=out, width=200))
    assert [(r["label"], r["upload_mbps"]) for r in rows] == [
        (label, cap_mbps) for label, _ in VERIFY_CASES
    ]
    for r in rows:
        # 2 peers: each sends half its vector as a part and half as an aggregate (plus small messages)
        assert 4 * numel <= r["bytes_sent_per_peer"] <= 1.1 * 4 * numel
        assert r["cpu_s_per_peer"] > 0
        # the cap is a floor on the data phase: bytes beyond the limiter's burst at the capped rate
        floor = (4 * numel - max(RECORD_BYTES, cap_mbps * 1e6 / 8 * 0.02)) / (cap_mbps * 1e6 / 8)
        assert r["data_s"] >= floor
    text = out.getvalue()
    assert "CClip+verify" in text and "200 Mbit/s" in text
    assert text.count("goal at 2 peers") == 1
    assert "the 2 peers share 1 CPU core here" in text
