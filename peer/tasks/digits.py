"""`digits-mlp`, the default task: scikit-learn's bundled 8×8 digits (no download) and a 64-64-10 MLP.

Small enough for CPU swarms and tests: one peer reaches ≥ 0.95 test accuracy in a
few hundred SGD steps.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import nn

from peer.tasks.base import Task

SPLIT_SEED = 0  # fixed forever: every peer and every run must see the same train/test split
TEST_FRACTION = 0.2


@lru_cache(maxsize=1)
def _load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    features = (data.data / 16.0).astype(np.float32)  # pixel counts 0..16 → [0, 1]
    labels = data.target.astype(np.int64)
    return tuple(  # type: ignore[return-value]
        train_test_split(features, labels, test_size=TEST_FRACTION, stratify=labels, random_state=SPLIT_SEED)
    )


def _mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))  # (B, 64) → (B, 10)


def digits_mlp(hidden: int = 64) -> Task:
    """The default task: 1437 training and 360 test images of 64 features in [0, 1], 10 classes."""
    train_x, test_x, train_y, test_y = _load_split()
    return Task(
        name="digits-mlp",
        model_fn=lambda: _mlp(hidden),
        # Copies: the cached arrays stay untouched whatever a caller does with the tensors.
        train_inputs=torch.tensor(train_x),
        train_targets=torch.tensor(train_y),
        test_inputs=torch.tensor(test_x),
        test_targets=torch.tensor(test_y),
        lr=0.1,
        batch_size=32,
    )
