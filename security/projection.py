"""Checking an aggregator with random projections (docs/algorithms.md §2 step 7).

CenteredClip's output v of part j satisfies Σ_i w_i (x_i − v)·min(1, τ/‖x_i − v‖) ≈ 0.
Projected on a direction z_j drawn from the round's public seed — unknown when v was
committed — every contributor i reports s_i = ⟨z_j, (x_i − v)·min(1, τ/‖x_i − v‖)⟩ and
‖x_i − v‖; anyone checks |Σ_i w_i s_i| ≤ tolerance, and the reducer, who holds every x_i,
checks each report. τ = ∞ checks a plain mean the same way.

z_j is cheap to draw at any size: a random unit block u (BLOCK values) times a random sign
per block, scaled to unit length. Its entries are unknown in advance, so a wrong v shows
up in the projection with constant probability, at the cost of one pass over the data.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 4096
FLOAT32_EPS = 2.0**-23
REPORT_REL_TOL = 1e-4  # reported vs recomputed projection, relative to its largest possible size
NORM_REL_TOL = 1e-5


@dataclass(frozen=True)
class Direction:
    """z = signs ⊗ u / sqrt(#blocks) for a part of `numel` values; ‖z‖ = 1 (up to the last partial block)."""

    u: Tensor  # (BLOCK,) float32, unit norm
    signs: Tensor  # (blocks,) float64, ±1
    numel: int

    def project(self, diff: Tensor) -> Tensor:
        """⟨z, row⟩ for each row of diff (k, numel) or a single vector (numel,): float64."""
        single = diff.dim() == 1
        rows = diff.reshape(1, -1) if single else diff
        full = (self.numel // BLOCK) * BLOCK
        # row by row: a (k, blocks, BLOCK) batch with a tail between rows would be copied by matmul
        per_block = torch.stack([row[:full].view(-1, BLOCK) @ self.u for row in rows])  # (k, full blocks) float32
        total = per_block.double() @ self.signs[: per_block.shape[1]]
        if full < self.numel:
            tail = rows[:, full:] @ self.u[: self.numel - full]
            total = total + tail.double() * self.signs[-1]
        total = total / math.sqrt(self.signs.numel())
        return total[0] if single else total


def direction(seed: bytes, part: int, numel: int, device: torch.device | str = "cpu") -> Direction:
    """The public random direction of part `part` in the round with public seed `seed`."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(hashlib.sha256(seed + b"z" + part.to_bytes(4, "little")).digest()[:8], "big") >> 1)
    u = torch.randn(BLOCK, generator=generator, dtype=torch.float64)
    u = (u / torch.linalg.vector_norm(u)).float()
    blocks = max(1, math.ceil(numel / BLOCK))
    signs = torch.randint(0, 2, (blocks,), generator=generator, dtype=torch.int64).double().mul_(2).sub_(1)
    return Direction(u.to(device), signs.to(device), numel)


def clip_factor(norm: Tensor | float, tau: float) -> Tensor | float:
    """min(1, τ/‖x − v‖), 1 at distance 0 (as CenteredClip does)."""
    if isinstance(norm, Tensor):
        return torch.where(norm > 0, (tau / norm).clamp(max=1.0), torch.ones_like(norm))
    return 1.0 if norm <= 0 else min(1.0, tau / norm)


CHUNK = 256 * BLOCK  # values per pass: the work buffer is (k, CHUNK), never a copy of the rows


def _differences(rows: Tensor, v: Tensor):
    """x_i − v chunk by chunk of whole blocks (the last one ends with the part's partial block), written
    into one small work buffer: yields (first block, chunk (k, n) float32). Each chunk is gone at the next."""
    k, numel = rows.shape
    work = torch.empty(k, min(CHUNK, numel), dtype=torch.float32, device=rows.device)
    for a in range(0, numel, CHUNK):
        b = min(a + CHUNK, numel)
        chunk = work if b - a == work.shape[1] else torch.empty(k, b - a, dtype=torch.float32, device=rows.device)
        torch.sub(rows[:, a:b].float(), v[a:b].float(), out=chunk)
        yield a // BLOCK, chunk


def distances(rows: Tensor, v: Tensor) -> Tensor:
    """‖x_i − v‖ (k,) float64 for every row of `rows` (k, numel): the half of a report that needs no seed,
    run while the data phase still moves bytes.

    Norms are taken per block in float32 and summed in float64, so that reporters, reducers and
    judges get the same numbers up to rounding. Chunks of a quarter million values: whole-tensor ops
    within a chunk (this runs in worker threads, every op a round trip through the GIL), and a work
    buffer of a few MB instead of a copy of the rows (a 100M-value part would cost 400 MB per row).
    """
    k = rows.shape[0]
    sumsq = torch.zeros(k, dtype=torch.float64, device=rows.device)
    for _, d in _differences(rows, v):
        full = d.shape[1] // BLOCK * BLOCK
        if full:
            sumsq += torch.linalg.vector_norm(d[:, :full].reshape(k, -1, BLOCK), dim=-1).double().square().sum(-1)
        if full < d.shape[1]:  # the part's last, partial block
            sumsq += torch.linalg.vector_norm(d[:, full:], dim=-1).double().square()
    return sumsq.sqrt()


def projections(rows: Tensor, v: Tensor, z: Direction) -> Tensor:
    """⟨z, x_i − v⟩ (k,) float64 for every row of `rows` (k, numel), once the seed is known; the
    differences are recomputed chunk by chunk, bit-identical to those `distances` saw."""
    k = rows.shape[0]
    total = torch.zeros(k, dtype=torch.float64, device=rows.device)
    for first, d in _differences(rows, v):
        full = d.shape[1] // BLOCK * BLOCK
        if full:
            per_block = d[:, :full].reshape(k, -1, BLOCK) @ z.u  # (k, blocks) float32
            total += per_block.double() @ z.signs[first : first + per_block.shape[1]]
        if full < d.shape[1]:
            total += (d[:, full:] @ z.u[: d.shape[1] - full]).double() * z.signs[-1]
    return total / math.sqrt(z.signs.numel())


def clipped_reports(proj: Tensor, norms: Tensor, tau: float) -> Tensor:
    """s_i = min(1, τ/‖x_i − v‖)·⟨z, x_i − v⟩, float64 (k,)."""
    return clip_factor(norms, tau) * proj


def report(x: Tensor, v: Tensor, z: Direction, tau: float) -> tuple[float, float]:
    """A contributor's (s, ‖x − v‖) for its part x (numel,) against the aggregate v."""
    s, norms = recompute(x.reshape(1, -1), v, z, tau)
    return float(s[0]), float(norms[0])


def recompute(rows: Tensor, v: Tensor, z: Direction, tau: float) -> tuple[Tensor, Tensor]:
    """(s, norms) float64 (k,) each for every row (k, numel), in one go (judges; tests)."""
    norms = distances(rows, v)
    return clipped_reports(projections(rows, v, z), norms, tau), norms


def report_matches(reported: tuple[float, float], true: tuple[float, float], tau: float) -> bool:
    """Whether a report equals the recomputed value up to float rounding."""
    s, norm = reported
    s_true, norm_true = true
    if not (math.isfinite(s) and math.isfinite(norm)):
        return False
    scale = float(clip_factor(norm_true, tau)) * norm_true  # the largest |s| can be (‖z‖ = 1)
    return abs(s - s_true) <= REPORT_REL_TOL * scale + 1e-12 and abs(norm - norm_true) <= NORM_REL_TOL * norm_true + 1e-12


def tolerance(
    reports: list[tuple[float, float]],
    weights: list[float],
    tau: float,
    eps: float,
    v_norm: float,
    numel: int,
    v_error: float = 0.0,
) -> float:
    """How far |Σ w_i s_i| may be from 0 for an honest aggregate of a part of `numel` values.

    CenteredClip stops once a step moves v by ≤ ε, so the residual R at the returned point has
    ‖R‖ ≤ ~3ε·Σw (the clipped map is 2-Lipschitz), plus up to 2·eps32·‖v‖·Σw from rounding v to
    float32. A random unit z sees ⟨z, R⟩ ~ N(0, ‖R‖²/numel): 6 standard deviations bound it for
    any honest run (false alarm < 1e-8). A lossy codec moves the sent aggregate by up to `v_error`
    (L2); near v each term w_i·c_i·(x_i − v) moves by at most 2·w_i·c_i·v_error, with c_i taken from the
    reported distance less v_error. Each s_i also carries float32 rounding of about 1e-5 of
    its size over the blocks. A wrong aggregate shifted by δ is caught once ‖δ‖ exceeds roughly
    1e-5·sqrt(BLOCK) ≈ 6e-4 of the typical clipped distance.
    """
    w_sum = sum(weights)
    blocks = max(1, math.ceil(numel / BLOCK))
    residual = w_sum * (3 * eps + 2 * FLOAT32_EPS * v_norm)
    if v_error > 0:
        residual += 2 * v_error * sum(w * float(clip_factor(max(n - v_error, 0.0), tau)) for (_, n), w in zip(reports, weights))
    clipped = sum(w * float(clip_factor(n, tau)) * n for (_, n), w in zip(reports, weights))
    return 6 * residual / math.sqrt(max(numel, 1)) + 1e-5 * clipped / math.sqrt(blocks) + 1e-12


def fixed_point_holds(
    reports: list[tuple[float, float]],
    weights: list[float],
    tau: float,
    eps: float,
    v_norm: float,
    numel: int,
    v_error: float = 0.0,
) -> bool:
    total = sum(w * s for (s, _), w in zip(reports, weights))
    return math.isfinite(total) and abs(total) <= tolerance(reports, weights, tau, eps, v_norm, numel, v_error)


STATE_PROJECTIONS = 2  # random directions per tensor when checking a downloaded state


def state_fingerprint(seed: bytes, tensors: list[Tensor]) -> list[float]:
    """For each tensor: ‖t‖ and its projections on STATE_PROJECTIONS directions drawn from `seed`.
    A state checked with a seed its sender could not know when it sent the state: any change to a
    tensor beyond rounding shows up in a projection with high probability."""
    out: list[float] = []
    for index, t in enumerate(tensors):
        flat = t.detach().reshape(-1).float()
        out.append(float(torch.linalg.vector_norm(flat.double())))
        for k in range(STATE_PROJECTIONS):
            out.append(float(direction(seed, index * STATE_PROJECTIONS + k, flat.numel()).project(flat)) if flat.numel() else 0.0)
    return out


def fingerprints_match(a: list[float], b: list[float], numels: list[int], rtol: float) -> bool:
    """Whether two states' fingerprints agree up to a relative drift `rtol` per tensor. Honest states
    differ only by rounding (every member applies the same averaged update), whose projection on a random
    unit direction is about ‖drift‖/√numel; 6 of those is the margin."""
    step = 1 + STATE_PROJECTIONS
    if len(a) != len(b) or len(a) != step * len(numels):
        return False
    for i, numel in enumerate(numels):
        na, nb = a[i * step], b[i * step]
        values = a[i * step : (i + 1) * step] + b[i * step : (i + 1) * step]
        if not all(math.isfinite(v) for v in values):
            return False
        scale = max(na, nb)
        if abs(na - nb) > rtol * scale + 1e-12:
            return False
        margin = 6 * rtol * scale / math.sqrt(max(numel, 1)) + 1e-12
        if any(abs(a[i * step + k] - b[i * step + k]) > margin for k in range(1, step)):
            return False
    return True
