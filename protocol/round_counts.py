"""How a peer's rounds ended, as one value: the engine counts them, and every reader (statistics(), the
trainer's report, health, the tools) takes this type instead of declaring the four counters again."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundCounts:
    """Rounds since this process started, by outcome."""

    ok: int = 0  # every part came back
    partial: int = 0  # some parts or senders were dropped; the rest was applied
    failed: int = 0  # aborted, timed out or a peer misbehaved: nothing applied
    resyncs: int = 0  # told to download a donor's state instead (a newcomer's first download included)
