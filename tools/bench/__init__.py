"""`phalanx bench …`: benchmarks that measure a reference in the same run and print ratios."""


def bench_console():
    """A rich console for result tables: the terminal's width, or 120 columns when output is piped to a
    file or CI log (rich would squeeze the tables into 80)."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=120)
