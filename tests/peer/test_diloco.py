"""DiLoCo: the outer Nesterov step against torch's, H = 1 against synchronous SGD through
`phalanx.Optimizer`, and `phalanx join --mode diloco` on three peers."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trainer_procs import join_args, spawn, start_script, wait_scripts

from phalanx.peer.outer_step import nesterov_outer_step

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("plain_loop", ROOT / "examples" / "plain_loop.py")
plain_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plain_loop)
SCRIPT = str(Path(__file__).parent / "api_diloco_peer.py")
# digits-mlp has 4810 parameters; in a round of 3 each peer sends 2/3 of the vector and 2/3 of the aggregate
FLOAT32_BYTES_OF_20_ROUNDS = 20 * 4 * 4810 * 4 / 3


def test_the_outer_step_is_torchs_nesterov_sgd_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=g)
    reference = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    momentum = torch.zeros(1000)
    for _ in range(20):
        delta = torch.randn(1000, generator=g) * 0.01
        nesterov_outer_step(theta, momentum, delta, lr=0.7, mu=0.9)
        reference.grad = delta.clone()
        sgd.step()
        assert torch.equal(theta, reference.detach())
        assert torch.equal(momentum, sgd.state[reference]["momentum_buffer"])


def _run(bootstrap, tmp_path, peers: int, *extra: str) -> list[dict]:
    logs = [tmp_path / f"{r}.log" for r in range(peers)]
    procs = [
        start_script(
            [
                SCRIPT,
                str(tmp_path / f"{r}.json"),
                "--initial-peers",
                *bootstrap,
                "--rank",
                str(r),
                "--peers",
                str(peers),
                *extra,
            ],
            logs[r],
        )
        for r in range(peers)
    ]
    wait_scripts(procs, logs)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(peers)]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_diloco_with_one_inner_step_outer_lr_1_and_no_momentum_is_synchronous_sgd(bootstrap, tmp_path):
    steps, peers, lr, batch = 20, 3, 0.1, 16
    results = _run(
        bootstrap,
        tmp_path,
        peers,
        "--outer-steps",
        str(steps),
        "--inner-steps",
        "1",
        "--outer-lr",
        "1",
        "--outer-momentum",
        "0",
        "--lr",
        str(lr),
    )
    train, _ = plain_loop.digits()
    model = plain_loop.make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    for t in range(steps):  # data-parallel SGD: the mean of the peers' gradients on their batch of step t
        batches = [plain_loop.batch(train, r, t, batch) for r in range(peers)]
        sgd.zero_grad()
        sum(F.cross_entropy(model(x), y) for x, y in batches).div(peers).backward()
        sgd.step()
    expected = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    for r in results:
        assert r["global_step"] == steps and r["peers_last_round"] == peers
        torch.testing.assert_close(torch.tensor(r["params"]), expected, atol=1e-6, rtol=0)
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_every_peer_ends_an_outer_step_with_identical_parameters_and_outer_momentum(bootstrap, tmp_path):
    results = _run(
        bootstrap,
        tmp_path,
        3,
        "--outer-steps",
        "6",
        "--inner-steps",
        "5",
        "--outer-lr",
        "0.7",
        "--outer-momentum",
        "0.9",
    )
    for r in results:
        assert r["global_step"] == 6 and r["local_steps"] == 30 and r["rounds_ok"] == 6
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]
    assert results[0]["outer_momentum"] == results[1]["outer_momentum"] == results[2]["outer_momentum"]
    assert any(v != 0.0 for v in results[0]["outer_momentum"])


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_phalanx_join_mode_diloco_trains_with_one_round_per_inner_steps(bootstrap, tmp_path, compression):
    common = (
        "--mode", "diloco", "--inner-steps", "10", "--steps", "200", "--eval-every", "50", "--wait-for-peers", "3",
        "--compression", compression,
    )  # fmt: skip
    procs = [spawn(join_args(bootstrap, tmp_path, n, *common), tmp_path / f"{n}.log") for n in "abc"]
    try:
        reports = [p.next_event("done", timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for report in reports:
        assert report["step"] == 200 and report["rounds_ok"] + report["rounds_partial"] >= 18, report
        assert report["rounds_ok"] + report["rounds_partial"] + report["rounds_failed"] <= 20
        assert report["accuracy"] >= 0.9, report
    assert len({r["param_hash"] for r in reports}) == 1  # 200 is a multiple of 10: they end on an outer step
    if compression == "int8":  # a quarter of float32's bytes per value, plus scales and headers
        assert max(r["bytes_sent"] for r in reports) < 0.4 * FLOAT32_BYTES_OF_20_ROUNDS
