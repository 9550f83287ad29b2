"""`tiny-gpt` trained by three `phalanx join` processes on loopback."""

import math

import hivemind
import pytest
from trainer_procs import LOOPBACK, join_args, spawn

# the swarm test: a model small enough for two shared cores, and a threshold measured on it
SWARM_OPTIONS = "dim=64,layers=2,heads=4,context=64"
TARGET_LOSS = 3.0  # one process at this size and batch 48: 5.49 untrained, 2.92 after 75 steps, 2.51 after 150


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_three_cli_peers_train_tiny_gpt_below_a_validation_loss_that_an_untrained_model_is_far_from(tmp_path):
    dht = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    boot = [str(m) for m in dht.get_visible_maddrs()]
    common = (
        "--task", "tiny-gpt", "--task-options", SWARM_OPTIONS, "--batch-size", "16", "--target-loss", str(TARGET_LOSS),
        "--eval-every", "25", "--steps", "600", "--wait-for-peers", "3",
    )  # fmt: skip
    procs = [spawn(join_args(boot, tmp_path, n, *common), tmp_path / f"{n}.log") for n in "abc"]
    try:
        first = procs[0].next_event("eval", timeout=300)
        assert first["step"] == 25 and first["loss"] > TARGET_LOSS + 1, first  # far above the target early on
        reports = [p.next_event("done", timeout=800) for p in procs]
        for report in reports:
            assert report["reached_target"], report
            assert report["step"] < 600
        evals = [e for e in procs[0].seen if e.get("event") == "eval"]
        assert evals[-1]["loss"] <= TARGET_LOSS and evals[-1]["perplexity"] == pytest.approx(
            math.exp(evals[-1]["loss"])
        )
        assert len({r["param_hash"] for r in reports}) == 1
        print(f"tiny-gpt swarm: {[(e['step'], round(e['loss'], 3)) for e in evals]}")
    finally:
        for p in procs:
            p.kill()
        dht.shutdown()
