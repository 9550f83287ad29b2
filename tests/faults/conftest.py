"""Fault tests need root (network namespaces, iptables, tc): skipped loudly, with a warning, otherwise."""

import warnings

import pytest

from phalanx.tools.lab.hosts import missing_requirements, sweep_stale


@pytest.fixture(scope="session")
def lab_machine():
    """Skip (loudly) where no lab can be built; remove namespaces that killed sessions left behind."""
    why = missing_requirements()
    if why:
        warnings.warn(f"SKIPPED fault tests: {why}", stacklevel=1)
        pytest.skip(f"SKIPPED: {why}")
    sweep_stale()
