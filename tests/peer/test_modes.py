"""peer/modes: the registry names a loop for every mode, and reading it costs no torch."""

import inspect
import subprocess
import sys

import pytest

from phalanx.aggregation.errors import ConfigError
from phalanx.peer.modes import MODES, mode_info, modes_help


@pytest.mark.parametrize("name", sorted(MODES))
def test_every_mode_loads_a_loop_the_runtime_can_run(name):
    loop = MODES[name].load()
    assert inspect.isclass(loop)
    assert isinstance(inspect.getattr_static(loop, "step"), property)
    assert inspect.iscoroutinefunction(loop.run)
    assert list(inspect.signature(loop).parameters) == ["runtime"]


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
