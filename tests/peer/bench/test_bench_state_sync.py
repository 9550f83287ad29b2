"""`phalanx bench state-sync`: donors in their own processes, the recipient checks every byte."""

from __future__ import annotations

import json

import pytest

from phalanx.cli import main
from phalanx.tools.bench.state_sync import run_state_sync_bench

pytestmark = pytest.mark.timeout(180)


def test_the_bench_downloads_from_one_and_from_two_donors_and_prints_the_ratio(tmp_path, capsys):
    out = tmp_path / "state.json"
    rows = run_state_sync_bench(3_000_000, [2], upload_mbit=400.0, repeats=1, json_path=out)  # 12 MB: two chunks
    assert [r["donors"] for r in rows] == [1, 2]  # one donor, the reference, always runs
    assert rows[0]["ratio"] == 1.0 and rows[1]["refetched_chunks"] == 0 and rows[1]["chunks"] == 2
    assert json.loads(out.read_text()) == rows
    assert "÷ one donor" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "state-sync", "--params", "lots"], "error: --params 'lots': use a count such as 100M"),
        (["bench", "state-sync", "--params", "1"], "error: --params '1': use from 2 to 4G values"),
        (["bench", "state-sync", "--donors", "1,40"], "error: --donors: use donor counts from 1 to 16"),
    ],
)
def test_bad_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1
