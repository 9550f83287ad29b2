"""peer/modes: the registry of modes, every one run by phalanx.Optimizer; reading it costs no torch."""

import subprocess
import sys

import pytest

from phalanx.errors import ConfigError
from phalanx.peer.modes import MODES, mode_info, modes_help


def test_every_mode_of_phalanx_join_is_one_the_optimizer_runs():
    from phalanx.peer.optimizer import API_MODES

    assert list(MODES) == list(API_MODES)


def test_an_unknown_mode_is_a_config_error_listing_the_valid_ones():
    with pytest.raises(ConfigError, match=r"^--mode: unknown mode 'diloko'; valid: sync, lasgd, gossip, diloco$"):
        mode_info("diloko")


def test_the_help_names_every_mode():
    assert modes_help().startswith("sync: gradients all-reduced every step; lasgd: ")
    assert all(f"{name}: " in modes_help() for name in MODES)


def test_reading_the_registry_imports_no_torch():
    probe = "import sys, phalanx.peer.modes; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
