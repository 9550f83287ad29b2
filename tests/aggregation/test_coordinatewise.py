"""mean, coordinate_median and trimmed_mean (aggregation/coordinatewise.py) against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phalanx.aggregation.coordinatewise import coordinate_median, mean, trimmed_mean
from phalanx.errors import AggregationInputError


def _weighted_median_ref(col: np.ndarray, w: np.ndarray) -> float:
    order = np.argsort(col, kind="stable")
    v, cw = col[order], np.cumsum(w[order])
    half = cw[-1] / 2
    lo = min(int(np.sum(cw < half)), len(v) - 1)
    hi = min(int(np.sum(cw <= half)), len(v) - 1)
    return (v[lo] + v[hi]) / 2


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13, 16])
def test_median_matches_numpy(n, device):
    x = torch.randn(n, 257, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    got = coordinate_median(x.to(device)).value
    assert got.device == x.to(device).device and got.dtype == torch.float64
    np.testing.assert_allclose(got.cpu().numpy(), np.median(x.numpy(), axis=0))


@pytest.mark.parametrize(("n", "b"), [(3, 1), (8, 1), (8, 3), (13, 4), (16, 7), (20, 0)])
def test_trimmed_mean_matches_numpy(n, b, device):
    x = torch.randn(n, 129, generator=torch.Generator().manual_seed(n + b), dtype=torch.float32)
    got = trimmed_mean(x.to(device), b=b).value.cpu().numpy()
    ref = np.sort(x.double().numpy(), axis=0)[b : n - b].mean(axis=0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_weighted_median_and_trimmed_mean_match_references(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=g, dtype=torch.float64)
    w = torch.rand(9, generator=g, dtype=torch.float64) + 0.1
    med = coordinate_median(x.to(device), w.to(device)).value.cpu().numpy()
    ref = [_weighted_median_ref(x[:, j].numpy(), w.numpy()) for j in range(64)]
    np.testing.assert_allclose(med, ref)
    tm = trimmed_mean(x.to(device), 2, w.to(device)).value.cpu().numpy()
    for j in range(64):
        order = np.argsort(x[:, j].numpy())[2:7]
        expected = np.sum(x[order, j].numpy() * w[order].numpy()) / np.sum(w[order].numpy())
        assert tm[j] == pytest.approx(expected, rel=1e-12)


def test_weighted_median_lands_on_half_and_averages():
    x = torch.tensor([[1.0], [2.0], [10.0]])
    assert coordinate_median(x, torch.tensor([1.0, 1.0, 2.0])).value.item() == 6.0  # cum 1, 2 = half of 4
    assert coordinate_median(x, torch.tensor([1.0, 3.0, 1.0])).value.item() == 2.0


def test_zero_weight_rows_do_not_count():
    x = torch.tensor([[1.0], [2.0], [3.0], [100.0]])
    assert coordinate_median(x, torch.tensor([1.0, 1.0, 1.0, 0.0])).value.item() == 2.0
    assert trimmed_mean(x, 1, torch.tensor([1.0, 1.0, 1.0, 0.0])).value.item() == 2.0


def test_weighted_mean(device):
    x = torch.tensor([[1.0, 0.0], [3.0, 4.0]], device=device)
    assert mean(x, torch.tensor([3.0, 1.0], device=device)).value.tolist() == [1.5, 1.0]
    assert mean(x).value.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("name", ["mean", "median", "trimmed"])
def test_permutation_invariance(name, device):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, 200, generator=g, dtype=torch.float64).to(device)
    w = (torch.rand(11, generator=g, dtype=torch.float64) + 0.5).to(device)
    perm = torch.randperm(11, generator=g).to(device)
    fn = {"mean": mean, "median": coordinate_median, "trimmed": lambda x, w=None: trimmed_mean(x, 3, w)}[name]
    for weights, pweights in [(None, None), (w, w[perm])]:
        torch.testing.assert_close(fn(x[perm], pweights).value, fn(x, weights).value, rtol=1e-12, atol=1e-12)


def test_trimmed_mean_needs_more_than_2b_rows():
    with pytest.raises(AggregationInputError) as e:
        trimmed_mean(torch.zeros(4, 3), b=2)
    assert str(e.value) == "trimmed_mean needs n > 2*b rows, got n=4 and b=2; lower b or add rows"


def test_trimmed_mean_counts_excluded_rows_against_b():
    x = torch.zeros(6, 3)
    x[0, 0] = float("nan")
    with pytest.raises(AggregationInputError) as e:
        trimmed_mean(x, b=4)
    assert str(e.value) == (
        "trimmed_mean needs n > 2*b rows, got n=5 and b=3 (after excluding 1 non-finite row, "
        "which count against b=4); lower b or add rows"
    )
