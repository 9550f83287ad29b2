"""The one ``name:key=value,key=value`` syntax of every pluggable rule: aggregators
(``bucketing:s=2,inner=mean``), attacks, the simulator's delays and workers.

Values parse as int, float (``inf`` too) or, failing both, stay text; each user decides
which types it takes. No torch here: the CLI parses specs before anything heavy loads.
"""

from __future__ import annotations

from typing import Union

from phalanx.errors import ConfigError

Value = Union[int, float, str]


def parse_spec(text: str, what: str) -> tuple[str, dict[str, Value]]:
    """``name:key=value,...`` → (name, params); ``what`` names the flag in errors."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what} must be a name like 'mean' or 'centered_clip:tau=1', got {text!r}")
    name, _, rest = text.strip().partition(":")
    try:
        return name.strip(), parse_params(rest)
    except ValueError:
        raise ConfigError(f"{what}={text!r}: parameters go as key=value after ':', e.g. centered_clip:tau=1") from None


def parse_params(text: str) -> dict[str, Value]:
    """``key=value,key=value`` → {key: value}; ValueError names the first item that is no pair."""
    params: dict[str, Value] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key:
            raise ValueError(item)
        params[key] = parse_value(value)
    return params


def parse_value(text: str) -> Value:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def aggregator_params(params: dict[str, Value], aggregator: str, flag: str) -> tuple[tuple[str, float | str], ...]:
    """An aggregator's parameters as peers hash them: numbers as floats (``s=2`` and ``s=2.0`` are one
    setting), sorted; text only for the parameters that name another rule (bucketing's inner=mean)."""
    out: list[tuple[str, float | str]] = []
    names: frozenset[str] | None = None
    for key, value in params.items():
        if not isinstance(value, str):
            out.append((key, float(value)))
            continue
        if names is None:
            from phalanx.aggregation.registry import name_parameters  # imports torch: only once a value is text

            names = name_parameters(aggregator)
        if key not in names or not value:
            hint = f" (--aggregator {aggregator} takes a name for {', '.join(sorted(names))})" if names else ""
            raise ConfigError(f"{flag} takes name=number pairs like tau=1, not '{key}={value}'{hint}")
        out.append((key, value))
    return tuple(sorted(out))


def parse_aggregator_params(text: str, aggregator: str = "", flag: str = "--aggregator-params"):
    """'tau=1,eps=1e-6' -> (('eps', 1e-6), ('tau', 1.0)); see `aggregator_params`."""
    try:
        params = parse_params(text)
    except ValueError as e:
        raise ConfigError(f"{flag} takes name=number pairs like tau=1, not {str(e)!r}") from None
    return aggregator_params(params, aggregator, flag)
