import logging

import pytest


@pytest.fixture(autouse=True)
def judges_log(caplog):
    """A failing test shows each judge's convictions and why (the rounds' INFO log)."""
    caplog.set_level(logging.INFO, logger="phalanx.protocol")
