"""The phases of a verified round in which members exchange messages, by their wire names.

An exchange header (protocol/exchange.py) names one, and a signed statement sent in a
phase has its name as its kind: a message under any other name is refused, so a member
can keep at most one message per phase in another member's mailbox. It lives below
protocol/ because security/ checks statement kinds too.
"""

from __future__ import annotations

import enum


class RoundPhase(enum.StrEnum):
    """In the order a round runs them; the values go on the wire (msgpack strings) and never change."""

    COMMIT = "commit"  # signed hashes of the parts a member will send, and its MPRNG commitment
    REVEAL = "reveal"  # MPRNG shares, echoing the commitments and aggregate statements each member got
    REPORT = "report"  # each contributor's projections of its parts against the aggregates, and its disputes
    ACCUSE = "accuse"  # accusations with their evidence, echoing every report judged by
    VOTE = "vote"  # signed ban votes (statements of kind "ban") and the disputes each member saw
