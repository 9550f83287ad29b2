"""The data behind the built-in image tasks: mnist-cnn's IDX files (tasks/mnist.py) and cifar10-resnet18
through torchvision, an optional extra (tasks/cifar.py)."""

from __future__ import annotations

import gzip
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.tasks import (
    compute_gradient,
    resolve_task,
)
from phalanx.tasks.cifar import PAD, _augment
from phalanx.tasks.mnist import MNIST_URL, read_idx

pytestmark = pytest.mark.timeout(60)



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
