"""DiLoCo: the outer Nesterov step against torch's, H = 1 against synchronous SGD through
`phalanx.Optimizer`, and `phalanx join --mode diloco` on three peers."""

import copy
import importlib.util
import json
import math
from pathlib import Path
from typing import Optional

import hivemind
import pytest
import torch
import torch.nn.functional as F

from phalanx.peer.outer_step import nesterov_outer_step
from tests.peer.stand_in_nodes import solo_node
from tests.peer.trainer_procs import LOOPBACK, join_args, spawn, start_script, wait_scripts

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
        assert r["global_step"] == 6 and r["local_steps"] == 30 and r["rounds"]["ok"] == 6
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]
    assert results[0]["outer_momentum"] == results[1]["outer_momentum"] == results[2]["outer_momentum"]
    assert any(v != 0.0 for v in results[0]["outer_momentum"])


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("compression", "overlap"), [("none", "off"), ("int8", "on"), ("topk:0.1", "off")])
def test_phalanx_join_mode_diloco_trains_with_one_round_per_inner_steps(bootstrap, tmp_path, compression, overlap):
    common = (
        "--mode", "diloco", "--inner-steps", "10", "--steps", "200", "--eval-every", "5", "--wait-for-peers", "3",
        "--compression", compression, "--overlap", overlap,
    )  # fmt: skip
    procs = [spawn(join_args(bootstrap, tmp_path, n, *common), tmp_path / f"{n}.log") for n in "abc"]
    try:
        reports = [p.next_event("done", timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for proc, report in zip(procs, reports, strict=True):
        assert report["step"] == 200 and report["rounds"]["ok"] + report["rounds"]["partial"] >= 18, report
        assert sum(report["rounds"][k] for k in ("ok", "partial", "failed")) <= 20
        # θ's accuracy. With overlap the delayed outer step is unstable here: 0.28–0.94 at step 200 in the
        # runs measured (docs/algorithms.md §8, why it is off by default); only its mechanics are asserted
        if overlap == "off":
            assert report["accuracy"] >= 0.9, report
        # θ_t is evaluated once per outer step (--eval-every 5 < H): a due evaluation waits for the next
        evals = [e for e in proc.seen if e["event"] == "eval"]
        outer = [e["outer_step"] for e in evals[:-1]]  # the run's last step is evaluated whatever the cadence
        assert len(outer) == len(set(outer)) and evals[-1]["step"] == 200, [(e["step"], e["outer_step"]) for e in evals]
    # 200 is a multiple of 10: they end on an outer step (with overlap too: the last boundary waits)
    assert len({r["param_hash"] for r in reports}) == 1
    if compression == "int8":  # a quarter of float32's bytes per value, plus scales and headers
        assert max(r["bytes_sent"] for r in reports) < 0.4 * FLOAT32_BYTES_OF_20_ROUNDS
    if compression == "topk:0.1":  # 10 % of the entries at 8 bytes each; the aggregates are a union of three
        assert max(r["bytes_sent"] for r in reports) < 0.6 * FLOAT32_BYTES_OF_20_ROUNDS


def _train_alone(outer_steps: int, overlap: str) -> dict:
    """api_diloco_peer.py's loop over a stand-in swarm of one (no network): θ, v and the steps."""
    import phalanx

    torch.manual_seed(0)
    train, _ = plain_loop.digits()
    model = plain_loop.make_model()
    opt = phalanx.Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), run_id="alone-diloco", batch_size_per_step=16, mode="diloco",
        inner_steps=5, outer_lr=0.7, outer_momentum=0.9, overlap=overlap, node=solo_node(),
    )  # fmt: skip
    with opt:
        step = 0
        while opt.global_step < outer_steps:
            inputs, labels = plain_loop.batch(train, 0, step, 16)
            F.cross_entropy(model(inputs), labels).backward()
            opt.step()
            opt.zero_grad()
            step += 1
        state = opt.state_dict()
        return {"global_step": opt.global_step, "local_steps": step, **state}


def test_overlap_in_a_swarm_of_one_is_the_strict_version():
    # alone, a peer's own estimate of θ_{t+1} is θ_{t+1}: moving the inner steps onto it changes nothing
    on = _train_alone(10, "on")
    # the loop ends once θ_10 is in, when the round after it may have landed too: compare at that step
    steps = on["global_step"]
    assert steps in (10, 11), on["global_step"]
    off = _train_alone(steps, "off")
    assert off["global_step"] == steps and off["local_steps"] == 5 * steps
    torch.testing.assert_close(on["outer_anchor"], off["outer_anchor"], atol=1e-6, rtol=0)
    torch.testing.assert_close(on["outer_momentum"], off["outer_momentum"], atol=1e-6, rtol=0)
    assert on["outer_momentum"].abs().sum() > 0  # outer steps were taken


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_with_overlap_every_peer_holds_the_same_outer_state_and_trains(bootstrap, tmp_path):
    results = _run(bootstrap, tmp_path, 3, "--outer-steps", "8", "--inner-steps", "5", "--outer-lr", "0.7",
                   "--outer-momentum", "0.9", "--overlap", "on")  # fmt: skip
    for r in results:
        assert r["global_step"] in (8, 9) and r["rounds"]["ok"] == r["global_step"], r
        assert math.isfinite(r["validation_loss"]), r  # how well overlap trains is not asserted (see above)
    # a script stops once θ_8 is in; the round after it may have landed on some peers too: compare by step
    by_step: dict[int, list[dict]] = {}
    for r in results:
        by_step.setdefault(r["global_step"], []).append(r)
    for same in by_step.values():
        assert all(r["outer_anchor"] == same[0]["outer_anchor"] for r in same)
        assert all(r["outer_momentum"] == same[0]["outer_momentum"] for r in same)
    assert max(len(same) for same in by_step.values()) >= 2
    assert results[0]["params"] != results[1]["params"]  # x: each peer's own inner steps since the boundary


def _diloco_trainer(attack: Optional[str], inner_steps: int = 3, **settings):
    """`phalanx join`'s trainer on digits-mlp in diloco mode, with a stand-in node and optimizer (no
    swarm: the contribution's math only); its outer step."""
    from types import SimpleNamespace

    from phalanx.peer.config import PeerConfig
    from phalanx.peer.outer_step import OuterStep
    from phalanx.peer.plan import make_plan
    from phalanx.peer.trainer import Trainer

    plan = make_plan(
        PeerConfig(mode="diloco", inner_steps=inner_steps, attack=attack, device="cpu", overlap="off", **settings)
    )
    trainer = Trainer(plan)
    node = SimpleNamespace(engine=SimpleNamespace(step=0), peer_id="12D3KooWattacker")
    outer = OuterStep(
        node, trainer.model.params, inner_steps=inner_steps, outer_lr=plan.outer.outer_lr,
        outer_momentum=plan.outer.outer_momentum, in_thread=None, topk_fraction=plan.outer.topk_fraction,
        contribute=trainer._attacked if trainer.attacks_delta else None,
    )  # fmt: skip
    trainer.opt = SimpleNamespace(mode=SimpleNamespace(outer=outer), node=node)
    return trainer, outer


@pytest.mark.parametrize("attack", ["sign_flip", "random_direction", "ipm", "alie", "nan", "delayed"])
def test_an_attacker_in_diloco_attacks_its_pseudo_gradient(attack):
    trainer, outer = _diloco_trainer(attack)
    assert outer.contribute is not None
    deltas, sent = [], []
    for t in range(3):
        outer.engine.step = t
        for step in range(t * 3, t * 3 + 3):  # honest inner steps
            _, grad = trainer._gradient(trainer.model.module, "12D3KooWattacker", step)
            trainer.model.apply(grad, step)
            outer.inner_step_done()
        deltas.append(outer.anchor - outer._flat())
        sent.append(outer.begin())
        outer.in_flight = False  # no round: x and θ_t stay, the next Δ counts from θ_t again
    for honest, contributed in zip(deltas, sent, strict=True):
        assert honest.abs().sum() > 0
        if attack == "sign_flip":
            torch.testing.assert_close(contributed, -1000.0 * honest)
        elif attack == "nan":
            assert torch.isnan(contributed).all()
        elif attack != "delayed":
            assert not torch.allclose(contributed, honest)
    if attack == "delayed":  # the oldest Δ it kept, again and again
        assert all(torch.equal(s, deltas[0]) for s in sent)


def test_an_alie_attacker_estimates_from_honest_deltas_of_h_inner_steps():
    trainer, outer = _diloco_trainer("alie")
    replica = trainer._replay("12D3KooWattacker/extra1")
    model = copy.deepcopy(trainer.model)
    for step in range(3):
        _, grad = trainer._gradient(model.module, "12D3KooWattacker/extra1", step)
        model.apply(grad, step)
    expected = outer.anchor - torch.nn.utils.parameters_to_vector(model.params).detach()
    assert torch.equal(replica, expected)  # H = 3 honest steps from θ_t, on the copy; the model untouched
    assert torch.equal(outer._flat(), outer.anchor)
    for state in trainer.model.optimizer.state.values():  # and so is its optimizer's state
        assert all(not torch.is_tensor(v) or not v.any() for v in state.values())


def test_label_flip_in_diloco_flips_the_inner_data_and_sends_delta_as_it_is():
    trainer, outer = _diloco_trainer("label_flip")
    assert outer.contribute is None and trainer.attack.flips_labels


def test_the_trainer_computes_its_gradient_as_validators_recompute_it():
    """The loop's honest gradient and a validator's (the optimizer's loss_fn on batch_fn) are the same bits."""
    trainer, outer = _diloco_trainer(None, verify=True, aggregator="mean")
    module = trainer.model.module
    trainer.opt.position = 4
    loss = trainer._backward(trainer.opt)
    mine = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    module.zero_grad(set_to_none=True)
    again = trainer.loss(module, trainer.public_batch(trainer.config.seed, "12D3KooWattacker", 4))
    again.backward()
    assert torch.equal(mine, torch.cat([p.grad.reshape(-1) for p in module.parameters()])) and loss == again.detach()
    _, flat = trainer._gradient(copy.deepcopy(module), "12D3KooWattacker", 4)  # compute_gradient, attackers' path
    assert torch.equal(mine, flat)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_resumed_diloco_peers_hold_theta_and_momentum_and_train_on_together(bootstrap, tmp_path):
    common = ("--mode", "diloco", "--inner-steps", "10", "--eval-every", "50", "--wait-for-peers", "2")

    def run(steps: int, *extra: str, initial_peers=bootstrap) -> list[dict]:
        procs = [
            spawn(join_args(initial_peers, tmp_path, n, *common, "--steps", str(steps), "--checkpoint-dir",
                            str(tmp_path / f"ckpt-{n}"), *extra), tmp_path / f"{n}-{steps}.log")  # fmt: skip
            for n in "ab"
        ]
        try:
            return [p.next_event("done", timeout=400) for p in procs]
        finally:
            for p in procs:
                p.kill()

    first = run(60)
    from phalanx.peer.checkpoint import load_latest

    saved = [load_latest(tmp_path / f"ckpt-{n}") for n in "ab"]
    swarm = [ckpt.extra["swarm"] for ckpt in saved]  # the optimizer's state_dict() beyond the task optimizer's
    for ckpt, state in zip(saved, swarm):  # named by inner steps, like --checkpoint-every's; θ_6 and v beside the model
        assert ckpt.step == 60 and state["global_step"] == 6 and state["inner_steps_taken"] == 0
    assert torch.equal(swarm[0]["outer_anchor"], swarm[1]["outer_anchor"])
    assert torch.equal(swarm[0]["outer_momentum"], swarm[1]["outer_momentum"])
    assert swarm[0]["outer_momentum"].abs().sum() > 0
    assert len({r["param_hash"] for r in first}) == 1
    # the swarm restarts whole, on a fresh DHT: on the old one both peers' records of the first run are still
    # live, so --wait-for-peers 2 passes at once. A join reaching the other before it serves joins is sent
    # again (protocol/matchmaking.py), but one sent to its old address before its host is up fails, and the
    # joiner trains alone meanwhile; digits' steps are so short that all six outer steps are over in a second
    fresh = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    try:
        again = run(120, "--resume", initial_peers=[str(m) for m in fresh.get_visible_maddrs()])
    finally:
        fresh.shutdown()
    for report in again:  # the same θ, v and step: the same version, so no one resyncs
        assert report["step"] == 120 and report["rounds"]["resyncs"] == 0 and report["rounds"]["ok"] >= 5, report
    assert len({r["param_hash"] for r in again}) == 1


def test_topk_sends_the_largest_entries_and_a_failed_round_gives_them_back():
    trainer, outer = _diloco_trainer(None, compression="topk:0.1")
    assert outer.feedback is not None and outer.feedback.fraction == 0.1
    for step in range(3):
        _, grad = trainer._gradient(trainer.model.module, "12D3KooWpeer", step)
        trainer.model.apply(grad, step)
        outer.inner_step_done()
    delta = outer.anchor - outer._flat()
    sent = outer.begin()
    k = math.ceil(0.1 * delta.numel())
    assert int((sent != 0).sum()) <= k
    assert torch.equal(sent + outer.feedback.residual, delta)  # what is sent plus what is kept, exactly
    # the largest entries: every one sent is at least as large as any one kept
    assert float(sent[sent != 0].abs().min()) >= float(outer.feedback.residual.abs().max())
    assert float(sent.abs().max()) == float(delta.abs().max())
    outer.failed()  # nothing arrived: the residual is as before, and the next Δ covers the same steps
    assert not outer.feedback.residual.any() and outer.inner == 3
    assert torch.equal(outer.begin(), sent)


def test_with_overlap_a_failed_round_moves_the_steps_taken_since_back_off_the_estimate():
    trainer, outer = _diloco_trainer(None)
    outer.overlap = True

    def inner_steps(steps) -> None:
        for step in steps:
            _, grad = trainer._gradient(trainer.model.module, "12D3KooWpeer", step)
            trainer.model.apply(grad, step)
            outer.inner_step_done()

    inner_steps(range(3))
    boundary = outer._flat()
    outer.begin()
    estimate = outer._flat()
    assert not torch.equal(estimate, boundary)  # training goes on from our own estimate of θ_1
    inner_steps(range(3, 5))
    since = outer._flat() - estimate
    outer.failed()
    torch.testing.assert_close(outer._flat(), boundary + since, atol=1e-6, rtol=0)  # as if no round began
    assert outer.inner == 5 and outer.position == 5 and not outer.in_flight
