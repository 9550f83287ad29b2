"""`phalanx bench wan` on the lab, its smallest run: plain sync rounds at RTT 0 and 100 ms, a short window
each. The numbers are printed, not asserted (a shared 2-core machine); what is checked is that each cell
measured rounds of the whole swarm."""

import pytest

from phalanx.errors import ConfigError
from phalanx.tools.bench.wan import TRAINERS, run_wan_bench

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
