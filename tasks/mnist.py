"""`mnist-cnn`: MNIST read from the standard IDX files in a local folder, and a small CNN.

Nothing is downloaded: a missing file is a ConfigError that says which files to fetch,
from where, and where to put them. Files may be gzipped (`name.gz`).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from phalanx.errors import ConfigError
from phalanx.tasks.base import Task

MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"  # torchvision's mirror; the original
MNIST_ORIGINAL_URL = "http://yann.lecun.com/exdb/mnist/"  # site is often unreachable
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # training-set pixel statistics (on the [0, 1] scale)

# IDX type byte → big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: Path | str) -> np.ndarray:
    """Read one IDX file (plain, or gzipped when the name ends in .gz) into an array of its stored shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # includes gzip.BadGzipFile and truncated .gz streams
        raise ConfigError(f"cannot read IDX file {path}: {e}; download it again") from e
    # Header: two zero bytes, a type byte, a dimension count, then one big-endian uint32 per dimension.
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ConfigError(
            f"{path} is not an IDX file (magic number {raw[:4].hex() or 'missing'}); download it again"
        )
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise ConfigError(f"{path} is truncated inside its header; download it again")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header_size != expected:
        raise ConfigError(
            f"{path} holds {len(raw) - header_size} data bytes but its header {shape} needs {expected}; "
            "download it again"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(shape).astype(dtype.newbyteorder("="))


def _find(data_dir: Path, name: str) -> Path | None:
    # Accept the files flat in data_dir, or where torchvision's MNIST(root=data_dir) keeps them.
    for folder in (data_dir, data_dir / "MNIST" / "raw"):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def load_mnist(data_dir: Path | str) -> dict[str, np.ndarray]:
    """The four MNIST arrays by file name; ConfigError naming the missing files and where to get them."""
    data_dir = Path(data_dir).expanduser()
    found = {name: _find(data_dir, name) for name in MNIST_FILES}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise ConfigError(
            f"task mnist-cnn: data_dir={str(data_dir)!r} lacks {', '.join(missing)}; download "
            f"{', '.join(n + '.gz' for n in missing)} from {MNIST_URL} (mirror of {MNIST_ORIGINAL_URL}) "
            f"into {data_dir.resolve()} (gzipped or not), or pass --data-dir <folder holding them> (data_dir= in Python)"
        )
    arrays = {name: read_idx(path) for name, path in found.items() if path is not None}
    for split in ("train", "t10k"):
        images, labels = arrays[f"{split}-images-idx3-ubyte"], arrays[f"{split}-labels-idx1-ubyte"]
        if (
            images.ndim != 3
            or images.dtype != np.uint8
            or labels.ndim != 1
            or len(images) != len(labels)
            or (len(labels) and labels.max() > 9)
        ):
            raise ConfigError(
                f"task mnist-cnn: {split} files in {data_dir} hold images {images.shape} {images.dtype} and "
                f"labels {labels.shape}, not N uint8 images with N labels 0-9; download them again"
            )
    return arrays


def _preprocess(images: Tensor) -> Tensor:
    # (B, 1, 28, 28) uint8 → float, normalized with the training-set statistics.
    return (images.float() / 255.0 - MNIST_MEAN) / MNIST_STD


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # (B, 32, 14, 14)
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # (B, 64, 7, 7)
        nn.Flatten(),  # (B, 3136)
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),  # (B, 10)
    )


def mnist_cnn(data_dir: Path | str = "data/mnist") -> Task:
    """60k training and 10k test images kept as uint8 (B, 1, 28, 28); a 2-conv CNN (~420k parameters)."""
    arrays = load_mnist(data_dir)

    def images(name: str) -> Tensor:
        return torch.from_numpy(arrays[name]).unsqueeze(1)  # (N, 28, 28) → (N, 1, 28, 28)

    return Task(
        name="mnist-cnn",
        model_fn=_cnn,
        train_inputs=images("train-images-idx3-ubyte"),
        train_targets=torch.from_numpy(arrays["train-labels-idx1-ubyte"].astype(np.int64)),
        test_inputs=images("t10k-images-idx3-ubyte"),
        test_targets=torch.from_numpy(arrays["t10k-labels-idx1-ubyte"].astype(np.int64)),
        preprocess=_preprocess,
        lr=0.05,
        batch_size=64,
        default_target=0.95,
    )
