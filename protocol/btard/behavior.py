"""The hooks of a verified round where a member could lie: the base class is an honest member.

Attacks (protocol/adversary.py) override one hook each. The round imports this module, and
hooks get the calling round as `vr` typed loosely, so nothing here imports the round back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from phalanx.security.phases import RoundPhase


class Behavior:
    """An honest member."""

    name = "honest"
    silent = False  # joins groups, then sends nothing at all

    def committed_hashes(self, hashes: list[bytes]) -> list[bytes]:
        return hashes

    def sent_vector(self, vector: torch.Tensor) -> torch.Tensor:
        """What is actually sent after committing to `vector`."""
        return vector

    def claimed_weight(self, weight: float) -> float:
        return weight

    def signed_part_size(self, size: int) -> int:
        """The byte size this member signs for a part of `size` bytes."""
        return size

    def speaks(self, phase: RoundPhase) -> bool:
        """Whether this member sends its message of `phase` (it still collects the others')."""
        return True

    async def reported(self, vr: Any, part: int, s: float, norm: float) -> tuple[float, float]:
        """The (s, ‖x − v‖) this member reports for its contribution to `part`."""
        return s, norm

    def reports_for(self, vr: Any, body) -> dict[str, Optional[bytes]]:
        """Members that get another signed report than `body` (peer ID -> packed statement, or None: none)."""
        return {}

    def wrap_reducer(self, reducer: Callable) -> Callable:
        return reducer

    def aggregate_reply(self, vr: Any, receiver: int, header: bytes, payload):
        return header, payload

    def false_accusations(self, vr: Any, reports: dict) -> list[str]:
        return []

    def claimed_undelivered(self, vr: Any, undelivered: set[int]) -> set[int]:
        return undelivered

    def served_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state this member hands to peers that download it (as a donor, or keeps as a witness)."""
        return tensors

    def counted(self, vr: Any, received: list[int]) -> list[int]:
        """As a reducer: the received parts its aggregate is computed from."""
        return received
