"""The one exception tree of Phalanx.

It sits at the package root, below every package (``aggregation`` included), so every
package can raise and catch the same classes::

    PhalanxError
    ├── ConfigError            the local user's mistake: bad flag, file, name or input
    │   └── AggregationInputError   bad tensors handed to an aggregator or correction
    ├── PeerProtocolError      a remote peer misbehaved; the message is ban evidence
    ├── RoundTimeoutError      a phase of a round ran past its deadline
    ├── RoundAbortedError      a round could not complete (too few members left, ...)
    └── VerificationError      a check of an aggregate or contribution failed
"""

from __future__ import annotations


class PhalanxError(Exception):
    """Root of every error Phalanx raises on purpose."""


class ConfigError(PhalanxError, ValueError):
    """The local user asked for something invalid; the message names the field and the fix."""


class AggregationInputError(ConfigError):
    """Tensors given to an aggregator or staleness correction have the wrong shape, size or values."""


class PeerProtocolError(PhalanxError):
    """A remote peer sent something the protocol forbids (evidence against that peer)."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message if peer is None else f"{peer}: {message}")
        self.peer = peer


class RoundTimeoutError(PhalanxError, TimeoutError):
    """A phase of an averaging round ran past its deadline."""


class RoundAbortedError(PhalanxError):
    """An averaging round could not complete for this peer."""


class VerificationError(PhalanxError):
    """A check of an aggregate or of a contribution failed."""
