"""`phalanx bench wan` on the lab, its smallest run: plain sync rounds at RTT 0 and 100 ms, a short window
each. The numbers are printed, not asserted (a shared 2-core machine); what is checked is that each cell
measured rounds of the whole swarm."""

import pytest

from phalanx.errors import ConfigError
from phalanx.tools.bench.wan import TRAINERS, run_far_member_bench, run_wan_bench

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_the_wan_bench_measures_whole_rounds_at_each_round_trip_time(lab_machine, tmp_path):
    cells = run_wan_bench(["mean"], [100.0], window_s=8.0, json_path=tmp_path / "wan.json")
    assert [(c.case, c.rtt_ms) for c in cells] == [("mean", 0.0), ("mean", 100.0)]
    for cell in cells:
        assert cell.rounds > 0 and cell.s_per_round is not None and cell.group == TRAINERS, cell
    assert (tmp_path / "wan.json").read_text().count('"case"') == 2


def test_an_unknown_case_is_refused_before_any_lab_is_built():
    with pytest.raises(ConfigError, match="--cases: unknown nope"):
        run_wan_bench(["mean", "nope"], [100.0], window_s=8.0)


def test_the_far_member_bench_counts_rounds_and_measures_a_kill(lab_machine, tmp_path):
    """`phalanx bench far-member`, smallest: a short window and one SIGKILL (restarted). Its goal is
    printed, not asserted."""
    result = run_far_member_bench(25.0, 150.0, window_s=5.0, kills=1, json_path=tmp_path / "far.json")
    assert result.rounds > 0 and result.not_whole >= 0 and len(result.stalls_s) == 1, result
    assert result.bound_s == pytest.approx(3.0 + 3 * 0.35)
    assert '"met"' in (tmp_path / "far.json").read_text()
