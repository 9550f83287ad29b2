"""`phalanx`: the command line. Each command parses flags, sets up logging and hands off.

User mistakes (ConfigError) print one line naming the field and the fix and exit 2;
tracebacks appear only with --debug.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from aggregation.errors import ConfigError, PhalanxError
from peer.logs import configure_logging

app = typer.Typer(
    name="phalanx",
    help="Train one model on many volunteers' GPUs: Byzantine-tolerant, staleness-aware, peer to peer.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks: each measures its reference in the same run and prints ratios.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

_state = {"debug": False}


@app.callback()
def _root(
    log_format: str = typer.Option("text", "--log-format", help="text or json (one JSON object per line)."),
    debug: bool = typer.Option(False, "--debug", help="Verbose logs and full tracebacks."),
) -> None:
    _state["debug"] = debug
    try:
        configure_logging(log_format, debug=debug)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--log-format") from None


@bench_app.command("aggregate")
def bench_aggregate(
    n: str = typer.Option("8,16,32", "--n", help="Comma-separated numbers of rows (peers)."),
    d: str = typer.Option("1000000,10000000", "--d", help="Comma-separated vector sizes."),
    aggregators: str = typer.Option("all", "--aggregators", help="Comma-separated registry names, or 'all'."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto (every available device)."),
    repeats: int = typer.Option(5, "--repeats", min=1, help="Timed repetitions per cell (median reported)."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Time every aggregator against one read of its (n, d) input (x.sum(0), the memory-bandwidth floor).

    [bold]Examples[/bold]

      phalanx bench aggregate

      phalanx bench aggregate --n 8 --d 1000000 --aggregators mean,centered_clip --repeats 3
    """
    from peer.bench.aggregate import run_aggregate_bench

    run_aggregate_bench(
        ns=_int_list(n, "--n"),
        ds=_int_list(d, "--d"),
        names=None if aggregators == "all" else _str_list(aggregators),
        device=device,
        repeats=repeats,
        seed=seed,
    )


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers like 8,16, not {text!r}") from None
    if not values or min(values) <= 0:
        raise ConfigError(f"{flag} needs at least one positive integer, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: run the app and turn our errors into one-line messages."""
    try:
        app(args=argv)
    except KeyboardInterrupt:
        sys.exit(130)
    except PhalanxError as e:
        if _state["debug"]:
            raise
        typer.secho(f"error: {e}", err=True, fg="red")
        sys.exit(2 if isinstance(e, ConfigError) else 1)


if __name__ == "__main__":
    main()
