"""The `TASKS` registry and `resolve_task`, the one way to turn a task spec into a `Task`.

A spec is a registry name (`digits-mlp`) or a user's own factory as `package.module:factory`.
Peers exchange these names, so registered names are stable.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from phalanx.errors import ConfigError
from phalanx.tasks.base import Task
from phalanx.tasks.cifar import cifar10_resnet18
from phalanx.tasks.digits import digits_mlp
from phalanx.tasks.metric import METRICS
from phalanx.tasks.mnist import mnist_cnn
from phalanx.tasks.text import tiny_gpt

TaskFactory = Callable[..., Task]

DEFAULT_TASK = "digits-mlp"
TASKS: dict[str, TaskFactory] = {}


def register_task(name: str, factory: TaskFactory) -> None:
    """Add a built-in task; a name can be registered once."""
    if name in TASKS:
        raise ConfigError(f"task name {name!r} is already registered (to {TASKS[name].__qualname__}); pick another")
    TASKS[name] = factory


register_task("digits-mlp", digits_mlp)
register_task("mnist-cnn", mnist_cnn)
register_task("cifar10-resnet18", cifar10_resnet18)
register_task("tiny-gpt", tiny_gpt)


def resolve_task(spec: str, **options: Any) -> Task:
    """Build the task named by `spec` (registry name or `package.module:factory`) with `options`."""
    factory = _import_factory(spec) if ":" in spec else TASKS.get(spec)
    if factory is None:
        raise ConfigError(
            f"task={spec!r} is not a known task; use one of {', '.join(sorted(TASKS))}, "
            "or package.module:factory for your own"
        )
    _check_options(spec, factory, options)
    task = factory(**options)
    if not isinstance(task, Task):
        raise ConfigError(
            f"task={spec!r} returned {type(task).__name__}, not a phalanx.tasks.Task; make the factory return Task(...)"
        )
    if task.metric not in METRICS.values():  # health records and target flags know these two
        raise ConfigError(f"task={spec!r} has metric={task.metric!r}; give it phalanx.tasks.ACCURACY or VALIDATION_LOSS")
    return task


def _import_factory(spec: str) -> TaskFactory:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(f"task={spec!r} is not of the form package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"task={spec!r}: cannot import {module_name!r} ({e}); check the spelling and that it is on PYTHONPATH"
        ) from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"task={spec!r}: module {module_name!r} has no attribute {attr!r}; check the name")
    if not callable(factory):
        raise ConfigError(
            f"task={spec!r}: {module_name}.{attr} is a {type(factory).__name__}, not a callable returning a Task"
        )
    return factory


def _check_options(spec: str, factory: TaskFactory, options: dict[str, Any]) -> None:
    """Reject unknown or missing options with a config error instead of a TypeError from inside the factory."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # some builtins/callables have no signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"task={spec!r} does not take option(s) {', '.join(unknown)}; "
            f"it takes: {', '.join(accepted) or 'no options'}"
        )
    missing = [p.name for p in parameters if p.default is p.empty and p.name in accepted and p.name not in options]
    if missing:
        raise ConfigError(f"task={spec!r} needs option(s) {', '.join(missing)}; pass them as task options")
