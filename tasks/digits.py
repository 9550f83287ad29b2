"""`digits-mlp`, the default task: scikit-learn's bundled 8×8 digits (no download) and a 64-64-10 MLP.

Small enough for CPU swarms and tests: one peer reaches ≥ 0.95 test accuracy in a
few hundred SGD steps.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.tasks.base import Task

SPLIT_SEED = 0  # fixed forever: every peer and every run must see the same train/test split
TEST_FRACTION = 0.2


@lru_cache(maxsize=1)
def _load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train x, test x, train y, test y) as scikit-learn's load_digits + train_test_split(stratify=labels)
    give them, read without importing scikit-learn: its import costs each trainer about a second of CPU
    at start-up (tests/tasks/test_task_base.py checks that both give the same arrays)."""
    with gzip.open(_digits_csv()) as f:
        data = np.loadtxt(f, delimiter=",")
    features = (data[:, :-1] / 16.0).astype(np.float32)  # pixel counts 0..16 → [0, 1]
    labels = data[:, -1].astype(np.int64)
    train, test = stratified_split(labels, TEST_FRACTION, SPLIT_SEED)
    return features[train], features[test], labels[train], labels[test]


def _digits_csv() -> Path:
    """scikit-learn's bundled digits file (1797 rows of 64 pixel counts and a label), found without importing it."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        raise ConfigError("task digits-mlp needs scikit-learn's bundled digits data: pip install scikit-learn")
    return path


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices), step for step as scikit-learn's StratifiedShuffleSplit draws them
    (what train_test_split(..., stratify=labels, random_state=seed) runs), so the split stays the one
    every peer has always used."""
    n_test = math.ceil(test_fraction * len(labels))
    n_train = len(labels) - n_test
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(counts, n_train, rng)
    t_i = _approximate_mode(counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i, members in enumerate(by_class):
        shuffled = members.take(rng.permutation(counts[i]), mode="clip")
        train.extend(shuffled[: n_i[i]])
        test.extend(shuffled[n_i[i] : n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Per-class sample counts summing to n_draws (scikit-learn's; ties broken by `rng`)."""
    continuous = counts / counts.sum() * n_draws
    floored = np.floor(continuous)
    need = int(n_draws - floored.sum())
    if need > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (where,) = np.where(remainder == value)
            add = min(len(where), need)
            floored[rng.choice(where, size=add, replace=False)] += 1
            need -= add
            if need == 0:
                break
    return floored.astype(int)


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
        default_target=0.95,
    )
