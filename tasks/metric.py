"""What a task's evaluations are judged by: test accuracy (higher is better) for classifiers, validation
loss (lower is better, shown with its perplexity) for language models. Launchers, reports, health
records and the monitor show a run's quality through its task's `Metric`, and its target flag is the
metric's (`--target-accuracy`, `--target-loss`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Optional

MetricKey = Literal["accuracy", "loss"]


@dataclass(frozen=True)
class Metric:
    key: MetricKey
    """The key of `Task.evaluate()`'s result that is judged; stable: health records carry it."""
    label: str
    """What reports call it."""
    higher_is_better: bool
    columns: tuple[str, ...]
    """Table headers of its value and what follows from it."""

    @property
    def flag(self) -> str:
        """The flag that sets a run's target in this metric."""
        return f"--target-{self.key}"

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    def best(self, values: Iterable[float]) -> Optional[float]:
        values = list(values)
        if not values:
            return None
        return max(values) if self.higher_is_better else min(values)

    def cells(self, value: Optional[float]) -> list[str]:
        """The table cells of `value` under `columns` (blank: no evaluation yet)."""
        if value is None:
            return [""] * len(self.columns)
        if self.key == "loss":
            return [f"{value:.4f}", f"{perplexity(value):.2f}"]
        return [f"{value:.4f}"]

    def text(self, value: Optional[float]) -> str:
        """`value` in a sentence: "test accuracy 0.9612", "validation loss 2.5432 (perplexity 12.72)"."""
        if value is None:
            return f"{self.label} n/a"
        first, *rest = self.cells(value)
        return f"{self.label} {first}" + "".join(f" ({c} {v})" for c, v in zip(self.columns[1:], rest, strict=True))


def perplexity(loss: float) -> float:
    """exp(loss) of a mean cross-entropy in nats, capped where exp overflows."""
    return math.exp(min(loss, 50.0))


ACCURACY = Metric("accuracy", "test accuracy", True, ("accuracy",))
VALIDATION_LOSS = Metric("loss", "validation loss", False, ("val loss", "perplexity"))
METRICS: dict[str, Metric] = {m.key: m for m in (ACCURACY, VALIDATION_LOSS)}
