"""`phalanx sim run` / `phalanx sim grid`: help with examples, outputs and one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from phalanx.cli import app, main


@pytest.mark.parametrize("command", ["run", "grid"])
def test_help_has_examples(command):
    result = CliRunner().invoke(app, ["sim", command, "--help"])
    assert result.exit_code == 0
    assert "Examples" in result.output and f"phalanx sim {command}" in result.output


def test_run_prints_and_writes(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "sim",
            "run",
            "--method",
            "asgd",
            "--workers",
            "4",
            "--gradients",
            "40",
            "--eval-points",
            "2",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "final test accuracy" in result.output and "mean / max staleness" in result.output
    record = json.loads((out / "run.json").read_text())
    assert record["gradients"] == 40 and len(record["staleness"]) == 40
    assert (out / "curve.csv").read_text().startswith("updates,gradients,time_s,accuracy,loss,k")
    assert (out / "curve.png").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sim", "run", "--updates", "5", "--gradients", "5"], "error: give one budget, not --updates and --gradients"),
        (["sim", "run", "--method", "asgd", "--sync", "k:2"], "error: method 'asgd' is asynchronous with K = 1"),
        (["sim", "run", "--method", "k_async", "--sync", "k:"], "error: sync policy 'k:' is not valid"),
        (["sim", "grid", "--preset", "speed"], "error: --preset 'speed' is unknown; use one of staleness, byzantine, groups"),
        (["sim", "run", "--method", "ssgd", "--group-size", "4"], "error: method 'ssgd' has no groups; drop --group-size"),
        (["sim", "run", "--method", "grouped", "--group-size", "1"], "error: group size must be an integer >= 2"),
    ],
)
def test_user_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1
