"""docs/results.md from grid results: definitions, tables, plots and a check of each expected ordering.

The checks are computed from the numbers (so they stay true when the grids are rerun). A
hand-written reading between the READING markers is kept when the file is regenerated.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.protocol.groups import capture_probability, expected_captures
from phalanx.sim.byzantine import DEFAULT_LAG
from phalanx.sim.clock import VolunteerParams
from phalanx.sim.methods import METHODS, default_k
from phalanx.sim.presets import (
    BYZANTINE_ATTACKS,
    BYZANTINE_COUNTS,
    GROUPS_ATTACKS,
    GROUPS_SHARES,
    GROUPS_SIZES,
    GROUPS_UPDATES,
    GROUPS_WORKERS,
    NO_ATTACK,
    STALENESS_DELAYS,
    STALENESS_WORKERS,
    Preset,
    TableSpec,
    group_label,
    share_key,
)
from phalanx.sim.rules import DC_LAMBDA

READING_START = "<!-- reading:start (hand-written; kept when this file is regenerated) -->"
READING_END = "<!-- reading:end -->"
Summary = dict[tuple[str, str, str], dict[str, Any]]


@dataclass
class Section:
    """One preset's results, ready to render."""

    preset: Preset
    records: list[dict[str, Any]]
    summary: Summary
    figures: list[tuple[str, Path]]
    wall_s: float
    cpu_s: float
    jobs: int


@dataclass(frozen=True)
class Check:
    claim: str
    verdict: str
    evidence: str


def markdown_table(table: TableSpec, summary: Summary, *, digits: int = 3) -> str:
    """Mean final accuracy per cell; '—' where a cell has no runs; diverged runs are marked with †."""
    head = "| " + " | ".join(["", *(c[0] for c in table.columns)]) + " |"
    rule = "|" + "---|" * (len(table.columns) + 1)
    lines = [head, rule]
    for row in table.rows:
        cells = []
        for _, key, column in table.columns:
            cell = summary.get((key, row, column))
            if cell is None:
                cells.append("—")
            else:
                mark = "†" if cell["diverged"] else ""
                cells.append(f"{cell['final_accuracy']:.{digits}f}{mark}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _acc(summary: Summary, table: str, row: str, column: str) -> float | None:
    cell = summary.get((table, row, column))
    return None if cell is None else cell["final_accuracy"]


def _verdict(agree: int, total: int) -> str:
    if total == 0:
        return "not run"
    if agree == total:
        return "agrees"
    return "partly" if agree * 2 >= total else "disagrees"


def staleness_checks(summary: Summary) -> list[Check]:
    cells = [(n, d) for n in STALENESS_WORKERS for d in STALENESS_DELAYS]

    def g(row: str, n: int, d: str) -> float | None:
        return _acc(summary, "gradients", row, f"N={n} {d}")

    checks = []
    big = [(n, d) for n, d in cells if n >= 16 and g("nag_asgd", n, d) is not None]
    collapsed = [(n, d) for n, d in big if g("nag_asgd", n, d) < 0.5]  # type: ignore[operator]
    checks.append(
        Check(
            "NAG-ASGD collapses (accuracy < 0.5) by N = 16",
            _verdict(len(collapsed), len(big)),
            f"collapsed in {len(collapsed)} of {len(big)} cells with N >= 16; N = 8: "
            + ", ".join(f"{d} {_f(g('nag_asgd', 8, d))}" for d in STALENESS_DELAYS),
        )
    )
    pairs = [(g("sa", n, d), g("ga", n, d)) for n, d in cells]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    wins = sum(b > a for a, b in pairs)  # type: ignore[operator]
    checks.append(
        Check(
            "SA < GA",
            _verdict(wins, len(pairs)),
            f"GA above SA in {wins} of {len(pairs)} cells; mean SA {_mean(a for a, _ in pairs)}, "
            f"mean GA {_mean(b for _, b in pairs)}",
        )
    )
    ref = _acc(summary, "reference", "1 worker", "N=1")
    random_cells = [(n, "exp") for n in STALENESS_WORKERS]
    close = [(n, d) for n, d in random_cells if ref is not None and abs((g("dana_zero", n, d) or 0) - ref) <= 0.02]
    checks.append(
        Check(
            "DANA ≈ one worker under random (exp) delays (within 0.02)",
            _verdict(len(close), len(random_cells) if ref is not None else 0),
            f"one worker {_f(ref)}; DANA-Zero "
            + ", ".join(f"N={n} {_f(g('dana_zero', n, 'exp'))}" for n in STALENESS_WORKERS),
        )
    )
    methods = [m for m in METHODS if all(g(m, n, d) is not None for n, d in cells)]
    worst = {m: min(g(m, n, d) for n, d in cells) for m in methods}  # type: ignore[type-var]
    ranking = sorted(worst, key=lambda m: -worst[m])
    best_cells = [
        (n, d)
        for n, d in cells
        if g("dana_ga", n, d) is not None and g("dana_ga", n, d) >= max(g(m, n, d) for m in methods) - 0.01  # type: ignore[operator]
    ]
    checks.append(
        Check(
            "DANA-GA most robust (best worst-case accuracy), including constant round-robin delays",
            "agrees" if ranking and ranking[0] == "dana_ga" else "partly" if "dana_ga" in ranking[:3] else "disagrees",
            "worst cell over the grid: "
            + ", ".join(f"{m} {worst[m]:.3f}" for m in ranking[:4])
            + f"; DANA-GA within 0.01 of the best method in {len(best_cells)} of {len(cells)} cells; "
            + "DANA-Zero under const: "
            + ", ".join(f"N={n} {_f(g('dana_zero', n, 'const'))}" for n in STALENESS_WORKERS),
        )
    )

    def t(row: str, n: int, d: str) -> float | None:
        return _acc(summary, "time", row, f"N={n} {d}")

    for method in ("adasync", "hybrid"):
        for rival, label in (("ssgd", "SSGD (K = N)"), ("k_sync", "K-sync (fixed K = N/4)")):
            rows = [(t(method, n, d), t(rival, n, d)) for n, d in cells]
            rows = [r for r in rows if None not in r]
            wins = sum(a > b for a, b in rows)  # type: ignore[operator]
            checks.append(
                Check(
                    f"{method} beats {label} at equal virtual time",
                    _verdict(wins, len(rows)),
                    f"above in {wins} of {len(rows)} cells; mean {method} {_mean(r[0] for r in rows)}, "
                    f"{rival} {_mean(r[1] for r in rows)}",
                )
            )
    return checks


def byzantine_checks(summary: Summary) -> list[Check]:
    honest = _acc(summary, "b=0", "mean", NO_ATTACK)
    checks = []
    for label in ("CenteredClip tau=1", "CenteredClip tau=10"):
        drops = []
        for b in BYZANTINE_COUNTS:
            for attack in BYZANTINE_ATTACKS:
                a = _acc(summary, f"b={b}", label, attack)
                if a is not None and honest is not None:
                    drops.append((honest - a, b, attack))
        ok = sum(d <= 0.02 for d, _, _ in drops)
        worst = max(drops, default=(0.0, 0, ""))
        checks.append(
            Check(
                f"{label} within 0.02 of the no-attack accuracy under every attack",
                _verdict(ok, len(drops)),
                f"no attack (mean, b = 0) {_f(honest)}; within 0.02 in {ok} of {len(drops)} (b, attack) cells; "
                f"worst: b = {worst[1]}, {worst[2]}, {honest - worst[0] if honest is not None else float('nan'):.3f}",
            )
        )
    collapsed, hurt, total = [], 0, 0
    for b in BYZANTINE_COUNTS:
        for attack in BYZANTINE_ATTACKS:
            a = _acc(summary, f"b={b}", "mean", attack)
            if a is not None:
                total += 1
                hurt += honest is not None and a < honest - 0.05
                if a < 0.5:
                    collapsed.append(f"b={b} {attack}")
    checks.append(
        Check(
            "The mean collapses (accuracy < 0.5) under attack",
            _verdict(len(collapsed), total),
            f"collapsed in {len(collapsed)} of {total} (b, attack) cells ({', '.join(collapsed) or 'none'}); "
            f"lost more than 0.05 in {hurt} of {total}",
        )
    )
    return checks


def groups_checks(summary: Summary) -> list[Check]:
    checks = []
    one = group_label(GROUPS_WORKERS)
    for share in GROUPS_SHARES:
        key = share_key(share)
        for size in GROUPS_SIZES[1:]:
            gaps = []
            for attack in GROUPS_ATTACKS:
                a, ref = _acc(summary, key, group_label(size), attack), _acc(summary, key, one, attack)
                if a is not None and ref is not None:
                    gaps.append((ref - a, attack))
            ok = sum(g <= 0.01 for g, _ in gaps)
            worst = max(gaps, default=(0.0, ""))
            checks.append(
                Check(
                    f"{key} attackers, groups of {size}: within 0.01 of one group of all under every attack",
                    _verdict(ok, len(gaps)),
                    f"within 0.01 in {ok} of {len(gaps)} attacks; largest loss {worst[0]:+.3f} ({worst[1]})",
                )
            )
    return checks


def _groups_stats(summary: Summary) -> list[str]:
    lines = [
        "The honest peers after the last round: spread (max ‖θ_i − θ̄‖ / ‖θ̄‖), the worst single peer's "
        "accuracy, and the groups with a Byzantine majority over the run (seen / expected from the "
        "hypergeometric law, attacks pooled).",
        "",
        "| attackers | groups | spread, no attack | spread, attacked (mean) | worst peer, attacked (mean) | "
        "Byzantine-majority groups: seen / expected per run | P(one group has a majority) |",
        "|---|---|---|---|---|---|---|",
    ]
    for share in GROUPS_SHARES:
        key, b = share_key(share), round(share * GROUPS_WORKERS)
        for size in GROUPS_SIZES:
            row = group_label(size)
            clean = summary.get(("b=0", row, NO_ATTACK))
            cells = [summary.get((key, row, attack)) for attack in GROUPS_ATTACKS]
            cells = [c for c in cells if c is not None]
            spread = _sci(clean["final_spread"]) if clean else "—"
            attacked = _sci(statistics.fmean(c["final_spread"] for c in cells)) if cells else "—"
            worst = _mean(c["worst_peer_accuracy"] for c in cells)
            seen = statistics.fmean(c["captured_groups"] for c in cells) if cells else float("nan")
            expected = expected_captures(GROUPS_WORKERS, b, size, GROUPS_UPDATES)
            p = capture_probability(GROUPS_WORKERS, b, size)
            lines.append(f"| {key} | {row} | {spread} | {attacked} | {worst} | {seen:.1f} / {expected:.2f} | {p:.1e} |")
    return lines


def _sci(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _mean(xs: Any) -> str:
    xs = [x for x in xs if x is not None]
    return _f(statistics.fmean(xs)) if xs else "—"


def checks_table(checks: list[Check]) -> str:
    lines = ["| expected (papers) | ours | numbers |", "|---|---|---|"]
    lines += [f"| {c.claim} | **{c.verdict}** | {c.evidence} |" for c in checks]
    return "\n".join(lines)


DEFINITIONS = """\
## Definitions

- **Task and optimizer**: `digits-mlp` (scikit-learn's 8×8 digits, 1437 training and 360 test images,
  a 64-64-10 MLP), minibatch 32, learning rate 0.1; methods with momentum use γ = 0.9. Worker k's
  minibatch at its step s is `Task.batch(seed, "sim-k", s, 32)`, the same one a live peer would draw.
- **Virtual time**: every delay model has mean compute time 1.0 per minibatch for an average worker.
  `const`: exactly 1 (round-robin arrivals); `exp`: Exp(1); `shifted-exp`: 0.5 + Exp(0.5); `gamma`: Gamma(2, 0.5);
  `volunteer`: see below. Each worker has its own seeded generator, so all methods see the same workers.
- **Volunteer model**: persistent per-worker slowness LogNormal(σ = {speed_sigma}) × per-minibatch jitter
  LogNormal(σ = {jitter_sigma}) (both mean 1); with probability {tail_prob} a minibatch takes Pareto(α = {tail_alpha}, x_m = 1)
  times longer; **churn**: workers stay online Exp(mean {online_mean}) and leave for Exp(mean {offline_mean}). A worker
  that leaves mid-minibatch keeps its state and delivers the gradient when it returns, computed on the
  parameters it read before leaving: very stale.
- **Update**: one change of the model: one server step (K rows aggregated) for parameter-server methods,
  one local step of one worker for LASGD and gossip. **Gradient**: one minibatch gradient applied;
  cancelled (K-sync stragglers) or unfinished minibatches count nowhere.
- **Equal budgets**: *equal gradients* gives every method the same data (the staleness table, 2000);
  *equal virtual time* gives every method the same wall clock (T = 4000/N: the same N·T worker-time).
- **Staleness** of a row: model updates between the worker's read and the row's application (LASGD:
  local steps between a snapshot and its merge; gossip: changes to the worker's model between its read
  and its step). With N workers and K = 1 the mean is N − 1; under `const` delays it is exactly N − 1
  after the first round (a test checks it).
- **K-sync / K-async / K-batch-async** (Dutta et al.): K-sync: all N read θ, the first K gradients make
  the update, the other N − K are cancelled. K-async: the first K gradients to arrive (possibly stale)
  make the update; only those K workers then read the new θ, and they idle until it exists.
  K-batch-async: the first K minibatches, from any workers; a finished worker never idles, it reads the
  current θ at once, so a fast worker can contribute two minibatches to one update. Fixed K = N/4
  (at least 1); SSGD is K-sync with K = N. **AdaSync**: K-sync with K = min(N, ⌈√(F(w₀)/F(w_t))·K₀⌉)
  every T₀, K₀ = N/8, T₀ = horizon/20, F = EMA of honest minibatch losses. **Hybrid**: K-async with
  K(t) = max(1, ⌈min(1, t/T)·N⌉), T = horizon/2. Horizon: the time budget, or the budget's gradients / N.
- **Momentum**: `nag_asgd`, `ga_momentum` use Nesterov momentum at the server; DANA-Zero/GA and
  Multi-ASGD keep one momentum per worker at the server (aggregation/dana.py); DANA-Slim keeps it on
  the worker; LASGD and gossip use heavy-ball momentum per local model; the rest use plain SGD.
  DC-ASGD uses λ = {dc_lambda}.
- **LASGD**: H = 8 local steps between all-reduces; a worker snapshots after H steps once its previous
  all-reduce has completed; the all-reduce completes when all N snapshots are in, and each worker merges
  `x ← avg + (x_now − x_snapshot)` at its next step boundary. **Gossip** (AD-PSGD): average with one
  uniformly drawn peer, then apply the gradient computed on the model read before. Both are evaluated at
  the average of the N local models.
- **Byzantine**: the last b workers. Gradient-level attacks (aggregation/attacks.py) are omniscient and
  collude: they see the honest rows of the same update. Label flip: an honest computation with labels
  y → 9 − y. Delayed: a Byzantine worker replays its own honest gradient from {lag} of its contributions
  earlier. Sign flip: −1 × and −1000 × the honest mean; IPM ε = 0.5; ALIE with z from n and b; noise: N(0, 200²).
  Aggregators: b for trimmed mean is the run's b; Krum needs n > 2b + 2, so b = 7 uses b = 6.
- **Grouped rounds** (`grouped`): N peers, each with its own model, in synchronous rounds. Each peer
  takes a Nesterov step on its minibatch, then the peers are split into random groups of at most G,
  drawn afresh every round, and each group's members take the group's aggregate of their models
  (rows in gradient units, so τ means what it means for gradients; one group of all N is synchronous
  SGD on the aggregated steps). Attackers forge rows from their group's honest rows; where they are
  a majority of a group they send −1000 × the honest mean row. Evaluated: the honest peers' mean model.
- **Final / best accuracy**: test accuracy at the end of the budget / the best of the 21 evaluations.
"""


def _rel(path: Path, base: Path) -> str:
    return os.path.relpath(path, base)


def render(sections: list[Section], command: str, report_path: Path, reading: str | None) -> str:
    vp = VolunteerParams()
    out = [
        "# Simulator results: staleness, Byzantine workers and grouped rounds",
        "",
        "Generated by one command. Every run is seeded: on one machine the same command gives the same numbers. Elsewhere, runs that oscillate or diverge (const delays, attacks at b = 7) can land on other values, since float rounding differs:",
        "",
        f"<!-- doc-test: skip long: {sum(len(s.records) for s in sections)} simulated runs, minutes of CPU -->",
        "```bash",
        command,
        "```",
        "",
    ]
    for s in sections:
        out.append(
            f"- `{s.preset.name}`: {len(s.records)} runs, {s.wall_s / 60:.1f} min wall-clock with {s.jobs} "
            f"process(es), {s.cpu_s / 60:.1f} CPU-minutes (on an idle machine: about CPU-minutes / processes)."
        )
    out += [
        "",
        DEFINITIONS.format(
            speed_sigma=vp.speed_sigma,
            jitter_sigma=vp.jitter_sigma,
            tail_prob=vp.tail_prob,
            tail_alpha=vp.tail_alpha,
            online_mean=vp.online_mean,
            offline_mean=vp.offline_mean,
            dc_lambda=DC_LAMBDA,
            lag=DEFAULT_LAG,
        ),  # fmt: skip
        "Methods: " + "; ".join(f"`{m.name}` ({m.summary})" for m in METHODS.values()) + ".",
        "",
    ]
    for s in sections:
        out += _section(s, report_path)
    out += [
        "## Reading",
        "",
        READING_START,
        reading.strip() if reading else "_(no reading written yet)_",
        READING_END,
        "",
    ]
    return "\n".join(out)


def _section(s: Section, report_path: Path) -> list[str]:
    out = [f"## {s.preset.title}", ""]
    for table in s.preset.tables:
        out += [f"### {table.title}", "", table.note, "", markdown_table(table, s.summary), ""]
    if s.preset.name == "staleness":
        out += _staleness_stats(s.summary) + [""]
    if s.preset.name == "groups":
        out += _groups_stats(s.summary) + [""]
    out.append("† at least one seed diverged (non-finite parameters).")
    out.append("")
    for caption, path in s.figures:
        out += [f"![{caption}]({_rel(path, report_path.parent)})", ""]
    checks: Callable[[Summary], list[Check]] = {"staleness": staleness_checks, "groups": groups_checks}.get(
        s.preset.name, byzantine_checks
    )
    out += ["### Expected orderings (from the papers) against ours", "", checks_table(checks(s.summary)), ""]
    return out


def _staleness_stats(summary: Summary) -> list[str]:
    lines = [
        "Staleness of ASGD rows (mean / max over the run), equal-gradients grid:",
        "",
        "| N | " + " | ".join(STALENESS_DELAYS) + " |",
        "|---|" + "---|" * len(STALENESS_DELAYS),
    ]
    for n in STALENESS_WORKERS:
        cells = []
        for d in STALENESS_DELAYS:
            c = summary.get(("gradients", "asgd", f"N={n} {d}"))
            cells.append("—" if c is None else f"{c['mean_staleness']:.1f} / {c['max_staleness']}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", f"Fixed K of the K-family: N/4 = {', '.join(str(default_k(n)) for n in STALENESS_WORKERS)}."]
    return lines


def existing_reading(path: Path) -> str | None:
    """The hand-written reading of an existing report, if any."""
    if not path.exists():
        return None
    text = path.read_text()
    if READING_START not in text or READING_END not in text:
        return None
    return text.split(READING_START, 1)[1].split(READING_END, 1)[0]


def write_report(path: Path, sections: list[Section], command: str) -> Path:
    """(Re)write the report at ``path``, keeping its hand-written reading."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(sections, command, path, existing_reading(path)))
    return path
