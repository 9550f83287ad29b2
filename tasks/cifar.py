"""`cifar10-resnet18`: CIFAR-10 from a local folder and torchvision's ResNet-18.

torchvision is the optional extra `phalanx[vision]`, imported only when this task is
built. Training batches get the standard augmentation (4-pixel pad + random crop,
horizontal flip), drawn from the batch's own generator so peers can recompute it.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from phalanx.errors import ConfigError
from phalanx.tasks.base import Task

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # training-set channel statistics on the [0, 1] scale
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
PAD = 4  # pixels of zero padding before the random 32×32 crop


def _import_torchvision() -> ModuleType:
    try:
        import torchvision
    except ImportError as e:
        raise ConfigError(
            f"task cifar10-resnet18 needs torchvision, which cannot be imported ({e}): pip install 'phalanx[vision]'"
        ) from e
    return torchvision


def _resnet18(torchvision: ModuleType) -> nn.Module:
    model = torchvision.models.resnet18(num_classes=10)
    # The ImageNet stem (7×7 stride-2 conv + max-pool) shrinks 32×32 images to 8×8 before the
    # first block and costs ~10 points of accuracy; the usual CIFAR stem keeps 32×32.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _augment(images: Tensor, generator: torch.Generator) -> Tensor:
    """Random crop after zero padding, and horizontal flip, per image; (B, 3, 32, 32) uint8 in and out."""
    b, _, h, w = images.shape
    device = images.device
    # All random draws on the CPU generator (device-independent), then moved: 3·B small ints.
    dy = torch.randint(0, 2 * PAD + 1, (b,), generator=generator).to(device)
    dx = torch.randint(0, 2 * PAD + 1, (b,), generator=generator).to(device)
    flip = (torch.rand(b, generator=generator) < 0.5).to(device)
    padded = nn.functional.pad(images, (PAD, PAD, PAD, PAD))  # (B, 3, 40, 40)
    rows = dy[:, None] + torch.arange(h, device=device)  # (B, 32)
    cols = dx[:, None] + torch.arange(w, device=device)  # (B, 32)
    cols = torch.where(flip[:, None], cols.flip(1), cols)  # flipping = reading columns right to left
    batch_index = torch.arange(b, device=device)[:, None, None, None]
    channel_index = torch.arange(images.shape[1], device=device)[None, :, None, None]
    return padded[batch_index, channel_index, rows[:, None, :, None], cols[:, None, None, :]]  # (B, 3, 32, 32)


def _preprocess(images: Tensor) -> Tensor:
    mean = torch.tensor(CIFAR10_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std  # (B, 3, 32, 32) float


def _load(torchvision: ModuleType, data_dir: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    tensors: list[Tensor] = []
    for train in (True, False):
        try:
            dataset = torchvision.datasets.CIFAR10(root=str(data_dir), train=train, download=False)
        except RuntimeError as e:  # torchvision's "Dataset not found or corrupted"
            raise ConfigError(
                f"task cifar10-resnet18: data_dir={str(data_dir)!r} has no readable CIFAR-10 ({e}); download "
                f"{CIFAR10_URL} and extract it into {data_dir.resolve()} so that cifar-10-batches-py/ is inside, "
                "or pass --data-dir <folder holding cifar-10-batches-py> (data_dir= in Python)"
            ) from e
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # (N, 32, 32, 3) → (N, 3, 32, 32)
        tensors += [images, torch.tensor(dataset.targets, dtype=torch.int64)]
    train_x, train_y, test_x, test_y = tensors
    return train_x, train_y, test_x, test_y


def cifar10_resnet18(data_dir: Path | str = "data/cifar10") -> Task:
    """50k training and 10k test images kept as uint8 (B, 3, 32, 32); ResNet-18 (~11M parameters). No default
    target: it nears 0.95 test accuracy only after far more steps than a local swarm runs."""
    torchvision = _import_torchvision()
    train_x, train_y, test_x, test_y = _load(torchvision, Path(data_dir).expanduser())
    return Task(
        name="cifar10-resnet18",
        model_fn=lambda: _resnet18(torchvision),
        train_inputs=train_x,
        train_targets=train_y,
        test_inputs=test_x,
        test_targets=test_y,
        preprocess=_preprocess,
        augment=_augment,
        lr=0.1,
        weight_decay=5e-4,
        batch_size=128,
        eval_batch_size=1000,
    )
