"""The task registry (tasks/registry.py): built-in names, options, and user factories by import path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from phalanx.errors import ConfigError
from phalanx.tasks import (
    TASKS,
    Task,
    compute_gradient,
    register_task,
    resolve_task,
)

pytestmark = pytest.mark.timeout(60)



# --- registry and user tasks ---------------------------------------------------------------


def test_unknown_task_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_task("digits")
    assert str(info.value) == (
        "task='digits' is not a known task; use one of cifar10-resnet18, digits-mlp, mnist-cnn, tiny-gpt, "
        "or package.module:factory for your own"
    )


def test_duplicate_registration_raises() -> None:
    with pytest.raises(ConfigError, match=r"^task name 'digits-mlp' is already registered \(to digits_mlp\)"):
        register_task("digits-mlp", lambda: None)  # type: ignore[arg-type,return-value]
    assert TASKS["digits-mlp"].__name__ == "digits_mlp"  # the first registration stands


def test_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_task("digits-mlp", data_dir="x")
    assert str(info.value) == "task='digits-mlp' does not take option(s) data_dir; it takes: hidden"


def test_task_options_reach_the_factory() -> None:
    task = resolve_task("digits-mlp", hidden=16)
    assert sum(p.numel() for p in task.build_model().parameters()) == 64 * 16 + 16 + 16 * 10 + 10


USER_MODULE = '''
import torch
from torch import nn
from phalanx.tasks import Task

def make(width=3):
    x = torch.linspace(0, 1, 40).reshape(20, 2)
    y = (x[:, 0] > 0.5).long()
    return Task(name="user-task", model_fn=lambda: nn.Linear(2, width), train_inputs=x, train_targets=y,
                test_inputs=x, test_targets=y)

def needs_path(path):
    return make()

def not_a_task():
    return 42

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    name = "phalanx_test_user_tasks"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # undone after the test
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


def test_user_factory_by_import_path(user_module: str) -> None:
    task = resolve_task(f"{user_module}:make", width=2)
    assert isinstance(task, Task) and task.name == "user-task"
    model = task.build_model(seed=0)
    loss, grad = compute_gradient(task, model, 0, "peer-a", 0, 8)
    assert grad.shape == (6,) and loss > 0


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        (":missing", "task='{m}:missing': module '{m}' has no attribute 'missing'; check the name"),
        (":NOT_CALLABLE", "task='{m}:NOT_CALLABLE': {m}.NOT_CALLABLE is a int, not a callable returning a Task"),
        (":not_a_task", "task='{m}:not_a_task' returned int, not a phalanx.tasks.Task; make the factory return Task(...)"),
        (":needs_path", "task='{m}:needs_path' needs option(s) path; pass them as task options"),
        (":make:extra", "task='{m}:make:extra' is not of the form package.module:factory"),
        (":", "task='{m}:' is not of the form package.module:factory"),
    ],
)
def test_user_factory_errors(user_module: str, suffix: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_task(user_module + suffix)
    assert str(info.value) == message.format(m=user_module)


def test_user_module_that_does_not_import() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_task("no_such_package.tasks:make")
    assert str(info.value) == (
        "task='no_such_package.tasks:make': cannot import 'no_such_package.tasks' "
        "(No module named 'no_such_package'); check the spelling and that it is on PYTHONPATH"
    )
