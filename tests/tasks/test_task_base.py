"""Tasks (tasks/base.py, tasks/digits.py): deterministic models and batches, gradients a third peer can
recompute, evaluation, and the bundled digits split."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from phalanx.tasks import (
    DEFAULT_TASK,
    Task,
    batch_generator,
    compute_gradient,
    flat_params,
    resolve_task,
    set_flat_params,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def digits() -> Task:
    return resolve_task("digits-mlp")


# --- the default task --------------------------------------------------------------------


def test_default_task_is_digits(digits: Task) -> None:
    assert DEFAULT_TASK == "digits-mlp"
    assert digits.name == "digits-mlp"
    assert digits.train_inputs.shape == (1437, 64) and digits.test_inputs.shape == (360, 64)
    assert 0.0 <= digits.train_inputs.min() and digits.train_inputs.max() <= 1.0
    # Stratified: every class holds 20% ± one sample of the test split.
    counts = torch.bincount(digits.test_targets, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37


def test_digits_reaches_95_percent_on_one_peer(digits: Task) -> None:
    """SGD lr 0.1, momentum 0.9, batch 32: ≥ 0.95 test accuracy within 400 steps (evaluated every 50)."""
    model = digits.build_model(seed=0)
    optimizer = digits.make_optimizer(model.parameters(), lr=0.1)
    history = []
    for step in range(400):
        inputs, targets = digits.batch(0, "peer-a", step, 32)
        optimizer.zero_grad()
        digits.loss(model, inputs, targets).backward()
        optimizer.step()
        if (step + 1) % 50 == 0:
            history.append(digits.evaluate(model)["accuracy"])
            if history[-1] >= 0.95:
                break
    assert max(history) >= 0.95, history
    assert model.training  # evaluate restored train mode


def test_build_model_is_deterministic_and_leaves_global_rng_alone(digits: Task) -> None:
    rng_before = torch.get_rng_state()
    a, b, c = digits.build_model(seed=7), digits.build_model(seed=7), digits.build_model(seed=8)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(flat_params(a), flat_params(b))
    assert not torch.equal(flat_params(a), flat_params(c))


def test_batch_depends_only_on_seed_peer_and_step(digits: Task) -> None:
    rng_before = torch.get_rng_state()
    x, y = digits.batch(3, "peer-a", 5, 16)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert x.shape == (16, 64) and y.shape == (16,) and y.dtype == torch.int64
    x2, y2 = digits.batch(3, "peer-a", 5, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    for other in [(4, "peer-a", 5), (3, "peer-b", 5), (3, "peer-a", 6)]:
        assert not torch.equal(digits.batch(*other, 16)[0], x), other


def test_batch_seed_derivation_is_stable() -> None:
    # Peers on different versions must agree on every batch: changing this derivation breaks verification.
    assert batch_generator(0, "peer-a", 0).initial_seed() == 517283538086634519
    assert torch.randint(1437, (5,), generator=batch_generator(0, "peer-a", 0)).tolist() == [923, 1006, 297, 11, 938]


def test_compute_gradient_is_bit_identical_for_a_third_peer(digits: Task) -> None:
    worker, verifier = digits.build_model(seed=1), digits.build_model(seed=1)
    loss, grad = compute_gradient(digits, worker, 1, "peer-a", 9, 32)
    # The verifier's model has stale gradients from other work: compute_gradient must zero them.
    compute_gradient(digits, verifier, 1, "peer-b", 3, 32)
    loss2, grad2 = compute_gradient(digits, verifier, 1, "peer-a", 9, 32)
    assert isinstance(loss, float) and loss == loss2
    assert torch.equal(grad, grad2)
    assert grad.shape == (sum(p.numel() for p in worker.parameters()),)

    # Same as doing it by hand.
    reference = digits.build_model(seed=1)
    inputs, targets = digits.batch(1, "peer-a", 9, 32)
    nn.functional.cross_entropy(reference(inputs), targets).backward()
    assert torch.equal(grad, torch.cat([p.grad.reshape(-1) for p in reference.parameters()]))


def test_compute_gradient_counts_unused_parameters_as_zero() -> None:
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(2, 3)
            self.unused = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    task = _tiny_task("tiny", model_fn=WithUnused)
    model = task.build_model(0)
    _, grad = compute_gradient(task, model, 0, "p", 0, 4)
    assert grad.shape == (15,) and torch.equal(grad[9:], torch.zeros(6))


def test_flat_params_round_trip_copies(digits: Task) -> None:
    model = digits.build_model(seed=0)
    vec = flat_params(model)
    assert not vec.requires_grad
    new = torch.arange(vec.numel(), dtype=torch.float32)
    set_flat_params(model, new)
    assert torch.equal(flat_params(model), new)
    new.zero_()  # the model holds a copy, not a view of the vector
    assert flat_params(model)[1] == 1.0
    with pytest.raises(ValueError, match=r"^set_flat_params needs a vector of 4810 values, got shape \(3,\)$"):
        set_flat_params(model, torch.zeros(3))


def test_evaluate_restores_mode_and_reports_loss(digits: Task) -> None:
    model = digits.build_model(seed=0).eval()
    result = digits.evaluate(model, "cpu")
    assert set(result) == {"accuracy", "loss"}
    assert not model.training
    assert 0.0 <= result["accuracy"] <= 0.3  # untrained: about chance
    assert result["loss"] == pytest.approx(2.3, abs=0.2)  # ≈ ln(10)


def test_evaluate_in_chunks_matches_one_pass(digits: Task) -> None:
    model = digits.build_model(seed=0)
    whole = digits.evaluate(model)
    chunked = _tiny_copy(digits, eval_batch_size=7).evaluate(model)
    assert chunked["accuracy"] == whole["accuracy"]
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-6)


def test_make_optimizer_defaults_to_sgd_momentum(digits: Task) -> None:
    model = digits.build_model(seed=0)
    group = digits.make_optimizer(model.parameters()).param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 0.0)
    group = digits.make_optimizer(model.parameters(), lr=0.05, momentum=0.5, weight_decay=1e-4).param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.05, 0.5, 1e-4)


def test_to_device_moves_data_once() -> None:
    task = resolve_task("digits-mlp")
    assert task.to("cpu") is task and task.device == torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("SKIPPED: CUDA is not available here; the cuda half of to() is not exercised")
    task.to("cuda")
    assert task.train_inputs.is_cuda and task.test_targets.is_cuda
    model = task.build_model(seed=0)
    assert next(model.parameters()).is_cuda
    inputs, targets = task.batch(0, "peer-a", 0, 8)
    assert inputs.is_cuda and targets.is_cuda
    cpu_task = resolve_task("digits-mlp")
    assert torch.equal(inputs.cpu(), cpu_task.batch(0, "peer-a", 0, 8)[0])  # same batch on every device
    assert 0.0 <= task.evaluate(model)["accuracy"] <= 1.0


# --- helpers ------------------------------------------------------------------------------


def _tiny_task(name: str, model_fn: Callable[[], nn.Module]) -> Task:
    x = torch.linspace(0, 1, 16).reshape(8, 2)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    return Task(name=name, model_fn=model_fn, train_inputs=x, train_targets=y, test_inputs=x, test_targets=y)


def _tiny_copy(task: Task, **changes: object) -> Task:
    return dataclasses.replace(task, **changes)


def test_digits_split_is_scikit_learns_without_importing_it():
    # digits-mlp reads the bundled file and draws the stratified split itself (scikit-learn's import costs
    # each trainer about a second of CPU at start-up): the arrays must be exactly the ones scikit-learn gives.
    import subprocess

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from phalanx.tasks.digits import SPLIT_SEED, TEST_FRACTION, _load_split

    data = load_digits()
    labels = data.target.astype(np.int64)
    expected = train_test_split(
        (data.data / 16.0).astype(np.float32), labels, test_size=TEST_FRACTION, stratify=labels, random_state=SPLIT_SEED
    )
    for ours, theirs in zip(_load_split(), expected):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    probe = "import sys; from phalanx.tasks import resolve_task; resolve_task('digits-mlp'); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
