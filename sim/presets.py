"""The comparison grids of `phalanx sim grid --preset ...`: which runs, and which tables they fill.

staleness: every method × N ∈ {8, 16, 32} × delay ∈ {exp, const, volunteer} × seeds at an
equal gradient budget (2000 minibatches, i.e. equal data), the K-family again at equal
virtual time (T = 4000/N, i.e. equal compute: N·T worker-time units), and one worker
(Nesterov SGD) with the same 2000 gradients as the reference.
byzantine: SSGD with Nesterov momentum, N = 16, b ∈ {0, 3, 7}, every attack × aggregator,
150 updates each. Both use 2 seeds per cell unless told otherwise.
groups: grouped rounds of N = 512 peers with CenteredClip τ = 1, one group of all against
random groups of 32, 16 and 8, with 10 % and 20 % attackers; 150 rounds, 1 seed per cell.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.errors import ConfigError
from phalanx.sim.config import Budget, ByzantineConfig, SimConfig
from phalanx.sim.grid import GridRun
from phalanx.sim.methods import METHODS

STALENESS_WORKERS = (8, 16, 32)
STALENESS_DELAYS = ("exp", "const", "volunteer")
STALENESS_GRADIENTS = 2000
EQUAL_TIME_COMPUTE = 4000.0  # worker-time units: T = 4000 / N
# every method of one shared model or of N local models on a virtual clock: grouped rounds have their own grid
STALENESS_METHODS = tuple(name for name, spec in METHODS.items() if spec.family != "grouped")
EQUAL_TIME_METHODS = ("ssgd", "k_sync", "k_async", "k_batch_async", "asgd", "adasync", "hybrid")

BYZANTINE_WORKERS = 16
BYZANTINE_COUNTS = (3, 7)
BYZANTINE_UPDATES = 150
BYZANTINE_MOMENTUM = 0.9
# column label → attack spec
BYZANTINE_ATTACKS = {
    "sign flip": "sign_flip",
    "sign flip x1000": "sign_flip:scale=-1000",
    "random dir.": "random_direction",
    "label flip": "label_flip",
    "delayed": "delayed",
    "IPM eps=0.5": "ipm:eps=0.5",
    "ALIE": "alie",
    "noise": "gaussian",
}
# row label → aggregator spec (b for trimmed mean and Krum: the run's b, capped to be legal)
BYZANTINE_AGGREGATORS = {
    "mean": "mean",
    "median": "median",
    "trimmed mean": "trimmed_mean",
    "Krum": "krum",
    "geometric median": "geometric_median",
    "CenteredClip tau=1": "centered_clip:tau=1",
    "CenteredClip tau=10": "centered_clip:tau=10",
}
NO_ATTACK = "no attack"

GROUPS_WORKERS = 512
GROUPS_SIZES = (512, 32, 16, 8)
GROUPS_SHARES = (0.2, 0.1)
GROUPS_UPDATES = 150
GROUPS_AGGREGATOR = "centered_clip:tau=1"
GROUPS_ATTACKS = {"sign flip": "sign_flip", "ALIE": "alie", "IPM eps=0.5": "ipm:eps=0.5", "label flip": "label_flip"}


def group_label(size: int) -> str:
    return "one group" if size >= GROUPS_WORKERS else f"G={size}"


def share_key(share: float) -> str:
    return f"{round(share * 100)}%"


@dataclass(frozen=True)
class TableSpec:
    """A table of mean final accuracies; each column reads cells (table, row, column) of the summary."""

    key: str
    title: str
    note: str
    rows: tuple[str, ...]
    columns: tuple[tuple[str, str, str], ...]
    """(header, table key, column key) per column."""


@dataclass(frozen=True)
class Preset:
    name: str
    title: str
    runs: list[GridRun]
    tables: list[TableSpec]


def staleness_preset(seeds: int = 2) -> Preset:
    runs: list[GridRun] = []
    cells = [(n, d) for n in STALENESS_WORKERS for d in STALENESS_DELAYS]
    for seed in range(seeds):
        runs.append(
            GridRun("reference", "1 worker", "N=1", SimConfig(
                method="nag_asgd", workers=1, budget=Budget(kind="gradients", amount=STALENESS_GRADIENTS), seed=seed,
            ))
        )  # fmt: skip
        for n, delay in cells:
            for method in STALENESS_METHODS:
                budget = Budget(kind="gradients", amount=STALENESS_GRADIENTS)
                runs.append(GridRun("gradients", method, f"N={n} {delay}", _config(method, n, delay, budget, seed)))
            for method in EQUAL_TIME_METHODS:
                budget = Budget(kind="time", amount=EQUAL_TIME_COMPUTE / n)
                runs.append(GridRun("time", method, f"N={n} {delay}", _config(method, n, delay, budget, seed)))
    labels = [f"N={n} {d}" for n, d in cells]
    tables = [
        TableSpec(
            "gradients",
            "Final test accuracy at equal gradients",
            f"{STALENESS_GRADIENTS} minibatch gradients per run (equal data); mean over {seeds} seed(s).",
            STALENESS_METHODS,
            tuple((c, "gradients", c) for c in labels),
        ),
        TableSpec(
            "time",
            "Final test accuracy at equal virtual time",
            f"virtual time T = {EQUAL_TIME_COMPUTE:g}/N (equal compute: N·T worker-time units); "
            f"mean over {seeds} seed(s).",
            EQUAL_TIME_METHODS,
            tuple((c, "time", c) for c in labels),
        ),
        TableSpec(
            "reference",
            "Reference: one worker",
            f"Nesterov SGD, {STALENESS_GRADIENTS} gradients; mean over {seeds} seed(s).",
            ("1 worker",),
            (("N=1", "reference", "N=1"),),
        ),
    ]
    return Preset("staleness", "Staleness: methods × workers × delays", runs, tables)


def _config(method: str, n: int, delay: str, budget: Budget, seed: int) -> SimConfig:
    return SimConfig(method=method, workers=n, delay=delay, budget=budget, seed=seed)


def byzantine_preset(seeds: int = 2) -> Preset:
    runs: list[GridRun] = []
    budget = Budget(kind="updates", amount=BYZANTINE_UPDATES)
    for seed in range(seeds):
        for label, agg in BYZANTINE_AGGREGATORS.items():
            runs.append(GridRun("b=0", label, NO_ATTACK, _byz_config(agg, ByzantineConfig(), budget, seed)))
            for b in BYZANTINE_COUNTS:
                for column, attack in BYZANTINE_ATTACKS.items():
                    byz = ByzantineConfig(count=b, attack=attack)
                    runs.append(GridRun(f"b={b}", label, column, _byz_config(agg, byz, budget, seed)))
    rows = tuple(BYZANTINE_AGGREGATORS)
    tables = [
        TableSpec(
            f"b={b}",
            f"Final test accuracy, N = {BYZANTINE_WORKERS}, b = {b} Byzantine",
            f"SSGD with Nesterov momentum {BYZANTINE_MOMENTUM}, {BYZANTINE_UPDATES} updates, attacks from the "
            f"first update; '{NO_ATTACK}' is b = 0 with the same aggregator; mean over {seeds} seed(s).",
            rows,
            ((NO_ATTACK, "b=0", NO_ATTACK), *((c, f"b={b}", c) for c in BYZANTINE_ATTACKS)),
        )
        for b in BYZANTINE_COUNTS
    ]
    return Preset("byzantine", "Byzantine workers × aggregators", runs, tables)


def _byz_config(aggregator: str, byzantine: ByzantineConfig, budget: Budget, seed: int) -> SimConfig:
    return SimConfig(
        method="ssgd",
        workers=BYZANTINE_WORKERS,
        delay="exp",
        budget=budget,
        seed=seed,
        momentum=BYZANTINE_MOMENTUM,
        aggregator=aggregator,
        byzantine=byzantine,
    )


def groups_preset(seeds: int = 1) -> Preset:
    runs: list[GridRun] = []
    budget = Budget(kind="updates", amount=GROUPS_UPDATES)
    for seed in range(seeds):
        for size in GROUPS_SIZES:
            row = group_label(size)
            runs.append(GridRun("b=0", row, NO_ATTACK, _groups_config(size, ByzantineConfig(), budget, seed)))
            for share in GROUPS_SHARES:
                for column, attack in GROUPS_ATTACKS.items():
                    byz = ByzantineConfig(count=round(share * GROUPS_WORKERS), attack=attack)
                    runs.append(GridRun(share_key(share), row, column, _groups_config(size, byz, budget, seed)))
    rows = tuple(group_label(size) for size in GROUPS_SIZES)
    tables = [
        TableSpec(
            share_key(share),
            f"Final test accuracy, N = {GROUPS_WORKERS}, {share_key(share)} Byzantine "
            f"(b = {round(share * GROUPS_WORKERS)})",
            f"grouped rounds with Nesterov momentum 0.9 and CenteredClip τ = 1 in every group, {GROUPS_UPDATES} "
            f"rounds, attacks from the first; accuracy of the honest peers' mean model; '{NO_ATTACK}' is b = 0 "
            f"with the same groups; mean over {seeds} seed(s).",
            rows,
            ((NO_ATTACK, "b=0", NO_ATTACK), *((c, share_key(share), c) for c in GROUPS_ATTACKS)),
        )
        for share in GROUPS_SHARES
    ]
    return Preset("groups", "Grouped rounds: random groups against one group of all", runs, tables)


def _groups_config(size: int, byzantine: ByzantineConfig, budget: Budget, seed: int) -> SimConfig:
    return SimConfig(
        method="grouped",
        workers=GROUPS_WORKERS,
        group_size=None if size >= GROUPS_WORKERS else size,
        budget=budget,
        seed=seed,
        aggregator=GROUPS_AGGREGATOR,
        byzantine=byzantine,
    )


PRESETS = {"staleness": staleness_preset, "byzantine": byzantine_preset, "groups": groups_preset}
DEFAULT_SEEDS = {"staleness": 2, "byzantine": 2, "groups": 1}


def build_preset(name: str, seeds: int | None = None) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is unknown; use one of {', '.join(PRESETS)}")
    seeds = DEFAULT_SEEDS[name] if seeds is None else seeds
    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    return PRESETS[name](seeds)
