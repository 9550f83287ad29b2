"""Every fenced shell command and Python snippet of README.md and docs/ runs here, or says why not.

A block runs in a fresh temporary folder with this environment's `phalanx` and `python` first on PATH,
and must exit 0 within its time limit. A block that cannot run here (a remote address, docker, a GPU,
a download, minutes of training) carries a `<!-- doc-test: skip CATEGORY: reason -->` comment on the
line before it; the session's summary lists how many ran and every skip with its reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.markdown_blocks import PAGES, ROOT, SKIP_CATEGORIES, Block, blocks

TIMEOUT_S = 90  # one block; the slowest that runs (a swarm of 2 on digits) takes about 15 s

SNIPPETS = [b for page in PAGES for b in blocks(page) if b.kind is not None]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)  # the installed package, as a reader has it
    for key in [k for k in env if k.startswith("PHALANX_")]:
        del env[key]  # a reader's shell has none of the test's settings
    return env


def _shell_script(block: Block) -> str:
    if block.lang != "console":
        return block.code
    # console blocks: `$ command` lines run, the rest is output shown to the reader
    return "".join(line[2:] + "\n" for line in block.code.splitlines() if line.startswith("$ "))


@pytest.mark.parametrize("block", SNIPPETS, ids=[b.id for b in SNIPPETS])
def test_snippet(block: Block, tmp_path: Path) -> None:
    skip = block.skip
    if skip is not None:
        pytest.skip(f"{skip[0]}: {skip[1]}")
    if block.kind == "shell":
        command = ["bash", "-e", "-o", "pipefail", "-c", _shell_script(block)]
    else:
        script = tmp_path / "snippet.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    try:
        done = subprocess.run(command, cwd=tmp_path, env=_environment(), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id} ran over {TIMEOUT_S} s: make it smaller, or mark it "
                    f"`<!-- doc-test: skip long: why -->`")
    assert done.returncode == 0, (
        f"{block.id} exited {done.returncode}:\n{block.code}\n--- stdout (tail)\n{done.stdout[-3000:]}"
        f"\n--- stderr (tail)\n{done.stderr[-3000:]}"
    )


def test_every_snippet_is_run_or_skipped_for_a_listed_reason() -> None:
    """Markers parse, name a known category, and enough of the documentation actually runs."""
    errors, ran = [], 0
    for block in SNIPPETS:
        try:
            ran += block.skip is None
        except ValueError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)
    assert ran >= 8, f"only {ran} documentation snippets run here: the test would check almost nothing"
    # a marker must sit on a block the test reads: one before a block of another language is a mistake
    stray = [b.id for page in PAGES for b in blocks(page) if b.marker is not None and b.kind is None]
    assert not stray, f"doc-test markers on blocks that are neither shell nor Python: {stray}"


def test_skip_categories_are_documented() -> None:
    """The categories a skip may name, each with what it means (the summary prints them)."""
    assert set(SKIP_CATEGORIES) >= {"remote", "docker", "gpu", "network", "long"}


def test_readme_keeps_the_line_ci_runs() -> None:
    """CI (.ci/run) runs the README's test command: the two must stay the same line."""
    line = ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test,hf,lightning]' "
            "&& .venv/bin/python -m pytest")
    assert line in (ROOT / "README.md").read_text().splitlines()
    assert line in (ROOT / ".ci" / "run").read_text().splitlines()
