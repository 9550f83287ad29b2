"""docs/threat-model.md names the test that checks each row: every one it names exists."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "threat-model.md"


def _references() -> list[tuple[str, str | None]]:
    """(file, test or None) for each backticked `tests/…py[::test]` and `::test` (of the file before it)."""
    refs, last = [], None
    for ref in re.findall(r"`((?:tests/[\w/]+\.py)?(?:::\w+)?)`", PAGE.read_text()):
        path, _, name = ref.partition("::")
        last = path or last
        refs.append((last, name or None))
    return refs


def test_every_test_the_threat_model_names_exists():
    refs = _references()
    assert len(refs) >= 30, "the page names a test for every row"
    missing = []
    for path, name in refs:
        file = ROOT / path
        if not file.exists():
            missing.append(path)
            continue
        defined = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
        if name is not None and name not in defined:
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/threat-model.md names tests that do not exist: {missing}"
