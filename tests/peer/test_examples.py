"""The examples/ scripts, each run by two peers on loopback on a tiny config: they end with identical
parameters (sync mode: every step is one all-reduced gradient). The framework ones need the
optional extras (`pip install .[hf,lightning]`), which CI installs; without them they are skipped."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests.procs import start_script, wait_scripts

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _run_two_peers(script: str, bootstrap: list[str], tmp_path: Path, *extra: str) -> list[dict]:
    logs = [tmp_path / f"{rank}.log" for rank in range(2)]
    procs = [
        start_script(
            [
                str(ROOT / "examples" / script),
                "--initial-peers",
                *bootstrap,
                "--rank",
                str(rank),
                "--peers",
                "2",
                "--out",
                str(tmp_path / f"{rank}.json"),
                *extra,
            ],
            logs[rank],
            cwd=tmp_path,
            fresh=True,  # as a user runs it
        )  # fmt: skip
        for rank in range(2)
    ]
    wait_scripts(procs, logs)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]


def _needs(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"SKIPPED LOUDLY: {module} is not installed (pip install .[{extra}])")


def test_plain_loop_example(bootstrap, tmp_path):
    a, b = _run_two_peers("plain_loop.py", bootstrap, tmp_path, "--global-steps", "5", "--target-batch-size", "32")
    assert a["params"] == b["params"] and a["global_step"] == b["global_step"] == 5 and a["peers_last_round"] == 2


def test_hugging_face_trainer_example(bootstrap, tmp_path):
    _needs("transformers", "hf")
    a, b = _run_two_peers("hf_trainer.py", bootstrap, tmp_path, "--steps", "6", "--output-dir", str(tmp_path / "hf"))
    assert a["params"] == b["params"] and a["global_step"] == b["global_step"] == 6 and a["peers_last_round"] == 2


def test_lightning_example(bootstrap, tmp_path):
    _needs("lightning", "lightning")
    a, b = _run_two_peers("lightning_module.py", bootstrap, tmp_path, "--steps", "6")
    assert a["params"] == b["params"] and a["global_step"] == b["global_step"] == 6 and a["peers_last_round"] == 2
