"""After a session that ran the documentation's snippets: how many ran, and each skip with its reason."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter) -> None:
    ran, failed, skipped = [], [], []
    for outcome, bucket in (("passed", ran), ("failed", failed), ("skipped", skipped)):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if "test_doc_snippets.py::test_snippet[" not in nodeid or report.when not in ("call", "setup"):
                continue
            block = nodeid.split("[", 1)[1].rstrip("]")
            reason = report.longrepr[2].removeprefix("Skipped: ") if outcome == "skipped" else ""
            bucket.append((block, reason))
    if not (ran or failed or skipped):
        return
    write = terminalreporter.write_line
    terminalreporter.section("documentation snippets")
    write(f"{len(ran)} ran, {len(failed)} failed, {len(skipped)} skipped")
    for block, reason in skipped:
        write(f"  skipped {block}: {reason}")
