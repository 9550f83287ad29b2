"""Random-projection checks catch wrong aggregates and false reports, and pass honest ones."""

import math

import pytest
import torch

from phalanx.aggregation.centered_clip import centered_clip
from phalanx.security.projection import direction, fixed_point_holds, recompute, report, report_matches


def _rows(n=8, d=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * 0.01 + torch.randn(d, generator=g) * 0.05


@pytest.mark.parametrize("tau", [0.1, 1.0, math.inf])
@pytest.mark.parametrize("d", [50_000, 4096 * 3 + 17])
def test_honest_aggregate_passes_and_reports_match(tau, d):
    x = _rows(d=d)
    x[0] *= -1000  # an attacker row: clipping is active
    eps = 1e-6
    v = centered_clip(x, tau=tau, eps=eps, max_iter=10_000).value if math.isfinite(tau) else x.mean(0)
    z = direction(b"seed", 3, d)
    reports = [report(x[i], v, z, tau) for i in range(len(x))]
    s_all, norms = recompute(x, v, z, tau)
    for i, rep in enumerate(reports):
        assert report_matches(rep, (float(s_all[i]), float(norms[i])), tau)
    assert fixed_point_holds(reports, [1.0] * len(x), tau, eps, float(v.norm()), d)


def test_honest_aggregate_of_far_apart_rows_passes_with_default_settings():
    # rows ~1400 units apart against tau = 1: CenteredClip must reach its fixed point within its
    # default iteration cap, or every seed's check convicts the honest reducer
    x = torch.randn(4, 250_000, generator=torch.Generator().manual_seed(1))
    v = centered_clip(x, tau=1.0).value
    for k in range(10):
        z = direction(k.to_bytes(2, "little"), 0, x.shape[1])
        s, norms = recompute(x, v, z, 1.0)
        assert fixed_point_holds(list(zip(s.tolist(), norms.tolist())), [1.0] * 4, 1.0, 1e-6, float(v.norm()), x.shape[1])


@pytest.mark.parametrize("tau", [0.1, math.inf])
def test_wrong_aggregate_fails(tau):
    x = _rows()
    v = centered_clip(x, tau=tau, eps=1e-6, max_iter=10_000).value if math.isfinite(tau) else x.mean(0)
    caught = 0
    for k in range(20):  # the direction is random: a wrong v shows up with high probability
        z = direction(k.to_bytes(2, "little"), 0, x.shape[1])
        wrong = v + 0.05 * torch.randn(x.shape[1], generator=torch.Generator().manual_seed(k)) / math.sqrt(x.shape[1])
        reports = [report(x[i], wrong, z, tau) for i in range(len(x))]
        caught += not fixed_point_holds(reports, [1.0] * len(x), tau, 1e-6, float(wrong.norm()), x.shape[1])
    assert caught >= 15


def test_false_report_is_detected():
    x = _rows()
    v = x.mean(0)
    z = direction(b"s", 0, x.shape[1])
    s, norm = report(x[2], v, z, math.inf)
    true = (s, norm)
    assert not report_matches((s + 0.01 * norm, norm), true, math.inf)
    assert not report_matches((s, norm * 1.01), true, math.inf)
    assert not report_matches((float("nan"), norm), true, math.inf)


def test_direction_is_public_and_unit():
    a, b = direction(b"seed", 1, 8192), direction(b"seed", 1, 8192)
    assert torch.equal(a.u, b.u) and torch.equal(a.signs, b.signs)
    assert not torch.equal(direction(b"seed", 2, 8192).u, a.u)
    ones = torch.zeros(8192)
    ones[:4096] = a.u  # one full block
    assert abs(float(a.project(ones)) - float(a.signs[0]) / math.sqrt(a.signs.numel())) < 1e-6


def test_a_state_fingerprint_tells_rounding_from_a_changed_state():
    """Honest members' states differ by rounding only; a donor's change beyond that shows, along
    directions drawn after it sent the state, whatever its shape."""
    from phalanx.security.projection import fingerprints_match, state_fingerprint

    g = torch.Generator().manual_seed(0)
    state = [torch.randn(300, 100, generator=g), torch.randn(10, generator=g), torch.tensor([7]), torch.empty(0)]
    numels = [t.numel() for t in state]
    rounded = [t * (1 + 1e-7) if t.is_floating_point() else t for t in state]
    seeds = [bytes([i]) * 32 for i in range(50)]
    for seed in seeds:
        assert fingerprints_match(state_fingerprint(seed, state), state_fingerprint(seed, rounded), numels, 1e-4)
    for relative in (1e-2, 1.0):
        passed = 0
        for seed in seeds:
            poisoned = [t.clone() for t in state]
            noise = torch.randn(poisoned[0].shape, generator=g)
            poisoned[0] += noise * (relative * float(state[0].norm()) / float(noise.norm()))
            passed += fingerprints_match(state_fingerprint(seed, state), state_fingerprint(seed, poisoned), numels, 1e-4)
        assert passed == 0, (relative, passed)
    # an integer counter, a NaN, or a fingerprint of another shape do not match either
    other = [state[0], state[1], torch.tensor([8]), state[3]]
    assert not fingerprints_match(state_fingerprint(seeds[0], state), state_fingerprint(seeds[0], other), numels, 1e-4)
    bad = state_fingerprint(seeds[0], state)
    assert not fingerprints_match(bad, [float("nan")] * len(bad), numels, 1e-4)
    assert not fingerprints_match(bad, bad[:-1], numels, 1e-4)
