"""Tasks: deterministic models and batches, gradients a third peer can recompute, the registry and built-ins."""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from phalanx.aggregation.errors import ConfigError
from phalanx.tasks import (
    DEFAULT_TASK,
    TASKS,
    Task,
    batch_generator,
    compute_gradient,
    flat_params,
    register_task,
    resolve_task,
    set_flat_params,
)
from phalanx.tasks.cifar import PAD, _augment
from phalanx.tasks.mnist import MNIST_URL, read_idx

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


# --- registry and user tasks ---------------------------------------------------------------


def test_unknown_task_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_task("digits")
    assert str(info.value) == (
        "task='digits' is not a known task; use one of cifar10-resnet18, digits-mlp, mnist-cnn, "
        "or package.module:factory for your own"
    )


def test_duplicate_registration_raises() -> None:
    with pytest.raises(ConfigError, match=r"^task name 'digits-mlp' is already registered \(to digits_mlp\)"):
        register_task("digits-mlp", lambda: None)  # type: ignore[arg-type,return-value]
    assert TASKS["digits-mlp"].__name__ == "digits_mlp"  # the first registration stands


def test_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_task("digits-mlp", data_dir="x")
    assert str(info.value) == "task='digits-mlp' does not take option(s) data_dir; it takes: hidden"


def test_task_options_reach_the_factory() -> None:
    task = resolve_task("digits-mlp", hidden=16)
    assert sum(p.numel() for p in task.build_model().parameters()) == 64 * 16 + 16 + 16 * 10 + 10


USER_MODULE = '''
import torch
from torch import nn
from phalanx.tasks import Task

def make(width=3):
    x = torch.linspace(0, 1, 40).reshape(20, 2)
    y = (x[:, 0] > 0.5).long()
    return Task(name="user-task", model_fn=lambda: nn.Linear(2, width), train_inputs=x, train_targets=y,
                test_inputs=x, test_targets=y)

def needs_path(path):
    return make()

def not_a_task():
    return 42

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    name = "phalanx_test_user_tasks"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # undone after the test
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


def test_user_factory_by_import_path(user_module: str) -> None:
    task = resolve_task(f"{user_module}:make", width=2)
    assert isinstance(task, Task) and task.name == "user-task"
    model = task.build_model(seed=0)
    loss, grad = compute_gradient(task, model, 0, "peer-a", 0, 8)
    assert grad.shape == (6,) and loss > 0


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        (":missing", "task='{m}:missing': module '{m}' has no attribute 'missing'; check the name"),
        (":NOT_CALLABLE", "task='{m}:NOT_CALLABLE': {m}.NOT_CALLABLE is a int, not a callable returning a Task"),
        (":not_a_task", "task='{m}:not_a_task' returned int, not a phalanx.tasks.Task; make the factory return Task(...)"),
        (":needs_path", "task='{m}:needs_path' needs option(s) path; pass them as task options"),
        (":make:extra", "task='{m}:make:extra' is not of the form package.module:factory"),
        (":", "task='{m}:' is not of the form package.module:factory"),
    ],
)
def test_user_factory_errors(user_module: str, suffix: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_task(user_module + suffix)
    assert str(info.value) == message.format(m=user_module)


def test_user_module_that_does_not_import() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_task("no_such_package.tasks:make")
    assert str(info.value) == (
        "task='no_such_package.tasks:make': cannot import 'no_such_package.tasks' "
        "(No module named 'no_such_package'); check the spelling and that it is on PYTHONPATH"
    )


# --- mnist-cnn: IDX files --------------------------------------------------------------------


def _write_idx(path: Path, array: np.ndarray, type_byte: int = 0x08, gz: bool = False) -> Path:
    header = bytes([0, 0, type_byte, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def _write_mnist(folder: Path, n_train: int = 12, n_test: int = 5, gz: bool = False) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(folder / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), gz=gz)
        _write_idx(folder / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8), gz=gz)


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    assert np.array_equal(read_idx(_write_idx(tmp_path / "a-idx3-ubyte", images, gz=gz)), images)
    ints = np.array([[1, -2], [70000, 3]], dtype=np.int32)
    result = read_idx(_write_idx(tmp_path / "b-idx2-int", ints, type_byte=0x0C, gz=gz))
    assert np.array_equal(result, ints) and result.dtype == np.int32


def test_read_idx_rejects_corrupt_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad-idx1-ubyte"
    path.write_bytes(b"\x00\x01\x08\x01" + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(ConfigError) as info:
        read_idx(path)
    assert str(info.value) == f"{path} is not an IDX file (magic number 00010801); download it again"


def test_read_idx_rejects_truncated_data(tmp_path: Path) -> None:
    path = _write_idx(tmp_path / "short-idx1-ubyte", np.zeros(10, dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ConfigError) as info:
        read_idx(path)
    assert str(info.value) == f"{path} holds 7 data bytes but its header (10,) needs 10; download it again"


def test_read_idx_rejects_broken_gzip(tmp_path: Path) -> None:
    path = tmp_path / "x-idx1-ubyte.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError, match=r"^cannot read IDX file .*; download it again$"):
        read_idx(path)


@pytest.mark.parametrize("layout", ["flat", "flat-gz", "torchvision"])
def test_mnist_task_from_idx_files(tmp_path: Path, layout: str) -> None:
    folder = tmp_path / "MNIST" / "raw" if layout == "torchvision" else tmp_path
    _write_mnist(folder, gz=layout == "flat-gz")
    task = resolve_task("mnist-cnn", data_dir=tmp_path)
    assert task.train_inputs.shape == (12, 1, 28, 28) and task.train_inputs.dtype == torch.uint8
    assert task.test_targets.shape == (5,) and task.test_targets.dtype == torch.int64
    inputs, targets = task.batch(0, "peer-a", 0, 4)
    assert inputs.shape == (4, 1, 28, 28) and inputs.dtype == torch.float32
    model = task.build_model(seed=0)
    loss, grad = compute_gradient(task, model, 0, "peer-a", 0, 4)
    assert grad.shape == (sum(p.numel() for p in model.parameters()),) and loss > 0
    assert 0.0 <= task.evaluate(model)["accuracy"] <= 1.0


def test_mnist_missing_files_say_what_to_download(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError) as info:
        resolve_task("mnist-cnn", data_dir=tmp_path)
    assert str(info.value) == (
        f"task mnist-cnn: data_dir={str(tmp_path)!r} lacks t10k-labels-idx1-ubyte; download "
        f"t10k-labels-idx1-ubyte.gz from {MNIST_URL} (mirror of http://yann.lecun.com/exdb/mnist/) "
        f"into {tmp_path.resolve()} (gzipped or not), or pass --data-dir <folder holding them> (data_dir= in Python)"
    )


def test_mnist_mismatched_files(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(11, dtype=np.uint8))
    with pytest.raises(ConfigError, match=r"^task mnist-cnn: train files in .* labels \(11,\), not N uint8 images"):
        resolve_task("mnist-cnn", data_dir=tmp_path)


# --- cifar10-resnet18 (torchvision is an optional extra) ------------------------------------


def test_cifar_without_torchvision_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision` fail, installed or not
    with pytest.raises(ConfigError) as info:
        resolve_task("cifar10-resnet18", data_dir="nowhere")
    assert str(info.value) == (
        "task cifar10-resnet18 needs torchvision, which cannot be imported "
        "(import of torchvision halted; None in sys.modules): pip install 'phalanx[vision]'"
    )


def _fake_torchvision(images: np.ndarray | None) -> types.ModuleType:
    """Just enough of torchvision for the task: CIFAR10 (from `images`, or absent) and a resnet18 stand-in."""

    class CIFAR10:
        def __init__(self, root: str, train: bool, download: bool) -> None:
            assert download is False
            if images is None:
                raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")
            self.data = images if train else images[:3]
            self.targets = list(range(len(self.data)))

    class ResNetStandIn(nn.Module):
        def __init__(self, num_classes: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            self.fc = nn.Linear(64, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.maxpool(self.conv1(x)).mean((2, 3)))

    module = types.ModuleType("torchvision")
    module.datasets = types.SimpleNamespace(CIFAR10=CIFAR10)  # type: ignore[attr-defined]
    module.models = types.SimpleNamespace(resnet18=lambda num_classes: ResNetStandIn(num_classes))  # type: ignore[attr-defined]
    return module


def test_cifar_missing_data_says_what_to_download(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", _fake_torchvision(None))
    with pytest.raises(ConfigError) as info:
        resolve_task("cifar10-resnet18", data_dir=tmp_path)
    assert str(info.value) == (
        f"task cifar10-resnet18: data_dir={str(tmp_path)!r} has no readable CIFAR-10 (Dataset not found or "
        "corrupted. You can use download=True to download it); download "
        f"https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and extract it into {tmp_path.resolve()} "
        "so that cifar-10-batches-py/ is inside, or pass --data-dir <folder holding cifar-10-batches-py> (data_dir= in Python)"
    )


def test_cifar_task_layout_with_stand_in_torchvision(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    images = np.random.default_rng(0).integers(0, 256, (10, 32, 32, 3), dtype=np.uint8)  # torchvision's HWC
    monkeypatch.setitem(sys.modules, "torchvision", _fake_torchvision(images))
    task = resolve_task("cifar10-resnet18", data_dir=tmp_path)
    assert task.train_inputs.shape == (10, 3, 32, 32) and task.test_inputs.shape == (3, 3, 32, 32)
    assert torch.equal(task.train_inputs[4, 1], torch.from_numpy(images[4, :, :, 1]))
    model = task.build_model(seed=0)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)  # CIFAR stem
    assert isinstance(model.maxpool, nn.Identity)
    _, grad = compute_gradient(task, model, 0, "peer-a", 0, 4)
    assert grad.shape == (sum(p.numel() for p in model.parameters()),)


def test_cifar_augmentation_is_pad_crop_flip() -> None:
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = _augment(images, torch.Generator().manual_seed(5))
    # Reference: the same draws, one image at a time.
    generator = torch.Generator().manual_seed(5)
    dy = torch.randint(0, 2 * PAD + 1, (6,), generator=generator)
    dx = torch.randint(0, 2 * PAD + 1, (6,), generator=generator)
    flip = torch.rand(6, generator=generator) < 0.5
    padded = nn.functional.pad(images, (PAD, PAD, PAD, PAD))
    for i in range(6):
        crop = padded[i, :, dy[i] : dy[i] + 32, dx[i] : dx[i] + 32]
        assert torch.equal(out[i], crop.flip(2) if flip[i] else crop), i
    assert out.dtype == torch.uint8 and flip.any() and not flip.all()


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
