"""Configuration of the round protocol; no networking imports, so the CLI can build it cheaply."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from phalanx.errors import ConfigError


class Codec(str, enum.Enum):
    """Stable names, exchanged between peers and hashed into the run configuration."""

    NONE = "none"  # raw little-endian float32, zero-copy
    FP16 = "fp16"  # hivemind FLOAT16 (clamped to the fp16 range)
    UINT8 = "8bit"  # hivemind UNIFORM_8BIT (per-tensor codebook)
    INT8 = "int8"  # per-block absmax scale and int8 codes (aggregation/compression.py): a strict error bound
    SPARSE = "sparse"  # lossless: the nonzero entries (indices, float32 values) or dense float32, whichever is smaller

    @classmethod
    def parse(cls, name: str) -> "Codec":
        """The wire codec of a --compression value (topk:<fraction> sends sparse vectors)."""
        if name.startswith("topk:"):
            topk_fraction(name)
            return cls.SPARSE
        try:
            codec = cls(name)
        except ValueError:
            codec = None
        if codec is None or codec is cls.SPARSE:
            raise ConfigError(f"--compression must be one of {COMPRESSIONS}, not {name!r}") from None
        return codec


COMPRESSIONS = "none, fp16, 8bit, int8 or topk:<fraction>"


def topk_fraction(compression: str) -> Optional[float]:
    """The share of entries `--compression topk:<fraction>` sends; None for the other codecs."""
    if not compression.startswith("topk:"):
        return None
    try:
        fraction = float(compression.removeprefix("topk:"))
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        raise ConfigError(f"--compression {compression}: the fraction must be a number in (0, 1], like topk:0.01")
    return fraction


@dataclass(frozen=True, kw_only=True)
class MatchmakingConfig:
    """How groups form. Protocol-relevant: part of the run's configuration hash (but see LOCAL_FIELDS)."""

    min_group_size: int = 1
    """Fewest joiners (members plus resyncing peers) a group may close with at its deadline."""
    target_group_size: Optional[int] = None
    """Most members per group; None: one group of everyone ready (sync mode)."""
    matchmaking_timeout_s: float = 5.0
    """How long the leader waits for expected peers after the first join of a round."""
    join_timeout_s: float = 60.0
    """How long a peer keeps trying to get into a group before the round fails."""
    lockstep: bool = True
    """Members must hold the same state version and the rest resync (sync mode); False: everyone
    who joins is a member, whatever its version (lasgd, gossip)."""
    window_s: Optional[float] = None
    """Asynchronous modes: close a group this long after its first join, with whoever joined (sooner
    once every expected peer joined)."""
    group_size: Optional[int] = None
    """Lockstep modes: most members per group. More joiners in step are split into random groups of at
    most this many, which average their models as well as their gradients (mixing rounds,
    docs/algorithms.md §11); None: one group of everyone in step."""

    def __post_init__(self) -> None:
        if self.window_s is not None and self.window_s <= 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size must be ≥ 1, got {self.min_group_size}")
        if self.target_group_size is not None and self.target_group_size < max(2, self.min_group_size):
            raise ValueError(
                f"target_group_size ({self.target_group_size}) must be ≥ 2 and ≥ min_group_size ({self.min_group_size})"
            )
        if self.group_size is not None and (self.group_size < 2 or not self.lockstep):
            raise ValueError(f"group_size ({self.group_size}) must be ≥ 2, in lockstep modes only")
        if self.matchmaking_timeout_s <= 0 or self.join_timeout_s <= self.matchmaking_timeout_s:
            raise ValueError("need 0 < matchmaking_timeout_s < join_timeout_s")


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """Verification of rounds; protocol-relevant (hashed into the run key)."""

    tau: float
    """CenteredClip radius the reducers use (inf for the mean)."""
    eps: float = 1e-6
    """CenteredClip's stopping tolerance: the projection tolerance follows from it."""
    phase_timeout_s: float = 10.0
    """Each verification phase waits at most this long for the other members."""
    validators: int = 1
    """Members per round that each recompute another member's gradient (distinct targets, chosen by the seed)."""
    contribution_rtol: float = 1e-4
    """How far a recomputed gradient part may differ (relative L2) before it counts as forged."""
    validators_sit_out: bool = False
    """DiLoCo: the previous round's seed draws `validators` members that sit the next round out, having
    replayed the phase of a member each picked in secret instead of training; only they may accuse a
    member of a bad contribution. No member of a round recomputes anything while the others wait."""


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    """One averaging round. Protocol-relevant fields are hashed into the run key."""

    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    aggregator: str = "mean"
    """Registry name of the rule each reducer applies to its part (see aggregation.registry)."""
    aggregator_params: tuple[tuple[str, float | str], ...] = ()
    """Keyword parameters of the aggregator, e.g. (("tau", 1.0),) or (("inner", "mean"), ("s", 2.0))."""
    compression: Codec = Codec.NONE
    allreduce_timeout_s: float = 30.0
    """Reducers stop waiting for parts this long after the group forms; stalled members are dropped."""
    part_idle_timeout_s: Optional[float] = 5.0
    """A member from which no byte of its part arrived for this long (none yet, or they stopped), or
    whose connection broke, is dropped then rather than at `allreduce_timeout_s`: a dead, frozen or
    cut-off member costs one short partial round. Likewise a reducer that moved no byte for twice this
    long after our own part was reduced (unverified rounds). None: wait until the deadline."""
    state_timeout_s: float = 120.0
    state_donors: int = 4
    """A peer that resyncs downloads disjoint chunks of the state from this many of the round's members at
    once, the designated donor first (each chunk checked against the donor's digests); 1: the donor alone."""
    verify: Optional[VerifyConfig] = None
    """BTARD verification of every round (commitments, MPRNG, projections, validators, bans)."""

    def make_reducer(self):
        """(rows (n, d), weights (n,)) -> aggregate (d,) with the configured rule; unknown names and
        bad parameters raise ConfigError listing the valid ones."""
        from phalanx.aggregation.registry import make_aggregator

        params = dict(self.aggregator_params)
        if self.aggregator == CLIPPED_GOSSIP:
            return clipped_gossip_reducer(params)
        if self.verify is not None and self.aggregator == "centered_clip":
            params.setdefault("max_iter", 100_000)  # the projection check assumes it ran to convergence
        aggregate = make_aggregator(self.aggregator, **params)
        return lambda rows, weights: aggregate(rows, weights).value

    def fingerprint(self) -> str:
        """SHA-256 (hex) of every protocol-relevant field (protocol_fields): equal on peers whose rounds
        can run together, whatever their local waits; the run hash includes it."""
        encoded = json.dumps(protocol_fields(self), sort_keys=True, allow_nan=True)
        return hashlib.sha256(encoded.encode()).hexdigest()


# Fields of the round's configs (dotted names) that only this peer's own waiting depends on: peers
# may set them differently and still train together. Every other field is hashed into the run key
# (protocol_fields), so a field added later is hashed unless it is listed here.
LOCAL_FIELDS = frozenset(
    {
        "matchmaking.join_timeout_s",  # how long this peer keeps trying to get into a group
        "state_timeout_s",  # how long this peer waits for a state download when it resyncs
        "state_donors",  # how many members this peer downloads a state from at once
    }
)


def protocol_fields(config: RoundConfig) -> dict[str, Any]:
    """Every field of `config` but LOCAL_FIELDS, nested configs by dotted name (None where one is
    absent): what peers must agree on, for the run's hash. Values are JSON-serializable."""
    fields: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            name, value = prefix + f.name, getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, name + ".")
            elif name not in LOCAL_FIELDS:
                fields[name] = value.value if isinstance(value, enum.Enum) else value

    walk(config, "")
    return fields


CLIPPED_GOSSIP = "clipped_gossip"


def clipped_gossip_reducer(params: dict):
    """ClippedGossip for a gossip group: every member gets its own result,
    x_i + Σ_{j≠i} (1/k)·clip(x_j − x_i, τ), clipped per part (each reducer sees one part).
    A Byzantine member moves an honest one by at most τ/k per part; clipping is odd-symmetric,
    so the group's sum (hence its average) is kept."""
    import torch

    from phalanx.aggregation.gossip import clipped_gossip_update

    unknown = set(params) - {"tau"}
    if "tau" not in params or unknown:
        raise ConfigError("--aggregator clipped_gossip takes exactly one parameter, tau (e.g. --tau 1)")
    tau = float(params["tau"])

    def reduce(rows, weights):  # (k, d) -> (k, d): row i is member i's result
        k = rows.shape[0]
        out = torch.empty_like(rows)
        share = torch.full((k - 1,), 1.0 / k, dtype=torch.float64)
        for i in range(k):  # a loop over members, never over coordinates
            others = torch.cat([rows[:i], rows[i + 1 :]])
            out[i] = rows[i] if k == 1 else clipped_gossip_update(rows[i], others, share, tau).value
        return out

    return reduce


def verify_config_for(aggregator: str, params: tuple[tuple[str, float], ...], **options) -> VerifyConfig:
    """The verification settings that match the aggregator every reducer runs."""
    if aggregator == "mean":
        return VerifyConfig(tau=math.inf, eps=0.0, **options)
    if aggregator == "centered_clip":
        values = dict(params)
        if "tau" not in values:
            raise ConfigError("--verify with --aggregator centered_clip needs --tau (e.g. --tau 1): every verifier checks that radius")
        return VerifyConfig(tau=values["tau"], eps=values.get("eps", 1e-6), **options)
    raise ConfigError(
        f"--verify checks CenteredClip's fixed point and needs --aggregator centered_clip (or mean), not {aggregator!r}"
    )
