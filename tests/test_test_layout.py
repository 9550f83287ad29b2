"""The tests are one package: helpers are imported as `tests.…` (process helpers: tests.procs), never
found through folders pushed onto sys.path."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SYS_PATH_EDIT = re.compile(r"sys\.path\.(insert|append)\b")


def _sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_test_file_edits_sys_path():
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{n}"
        for path in _sources()
        if path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SYS_PATH_EDIT.search(line)
    ]
    assert not offenders, f"import helpers as tests.<folder>.<module> instead: {offenders}"


def test_every_test_folder_is_a_package():
    """A folder without __init__.py would be put on sys.path by pytest, and its helpers imported by bare name."""
    missing = sorted(
        {str(p.parent.relative_to(TESTS.parent)) for p in _sources() if not (p.parent / "__init__.py").exists()}
    )
    assert not missing, f"these folders need an __init__.py: {missing}"
