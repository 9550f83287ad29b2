"""BTARD (docs/algorithms.md §2): the verified round around a butterfly all-reduce. `round` runs one
member's view of it and composes the rest: `relay` (aggregates a reducer kept from a member),
`claims` (what reports dispute), `validator` (recomputing one member's gradient), `judge`
(accusations and ban votes), `service` (per peer: evidence held for judges), `messages` (the wire)."""

from phalanx.protocol.btard.messages import Recompute, Verdict
from phalanx.protocol.btard.round import VerifiedRound
from phalanx.protocol.btard.service import BtardService

__all__ = ["BtardService", "Recompute", "Verdict", "VerifiedRound"]
