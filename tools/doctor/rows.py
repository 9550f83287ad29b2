"""A doctor's row: one check's verdict, what was seen and, when it did not pass, the fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["pass", "warn", "fail", "skip"]
_STYLE = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "magenta"}


@dataclass(frozen=True)
class Row:
    check: str  # what was checked, e.g. "initial peer …3kV8xq: tcp"
    status: Status  # fail makes the command exit non-zero; skip says a check could not run, and why
    detail: str  # what was seen
    fix: str = ""  # what to do; every fail and warn row has one

    def line(self) -> str:
        """The row as one line (what `phalanx join` prints when a cheap check fails)."""
        return f"{self.check}: {self.detail}" + (f"; {self.fix}" if self.fix else "")


def ok(check: str, detail: str) -> Row:
    return Row(check, "pass", detail)


def failed(check: str, detail: str, fix: str) -> Row:
    return Row(check, "fail", detail, fix)


def warned(check: str, detail: str, fix: str) -> Row:
    return Row(check, "warn", detail, fix)


def skipped(check: str, why: str) -> Row:
    return Row(check, "skip", f"SKIPPED: {why}")


def exit_code(rows: list[Row]) -> int:
    """1 when any check failed, else 0 (warnings and skips do not fail the command)."""
    return int(any(r.status == "fail" for r in rows))


def rows_json(rows: list[Row]) -> dict[str, Any]:
    return {"ok": not exit_code(rows), "rows": [asdict(r) for r in rows]}


def render_table(rows: list[Row], *, title: str):
    from rich.table import Table
    from rich.text import Text  # plain text: a detail may hold brackets that rich would read as markup

    table = Table(title=title, expand=False, show_lines=False)
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(Text(r.check), Text(r.status, style=_STYLE[r.status]), Text(r.detail), Text(r.fix))
    return table
