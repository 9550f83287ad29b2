"""Training tasks: model + data + loss + evaluation, resolved by name or `package.module:factory`.

`resolve_task(spec, **options)` is the entry point; `TASKS` holds the built-ins
(`digits-mlp`, the default; `mnist-cnn`; `cifar10-resnet18`; `tiny-gpt`, a byte-level language model).
Each task's `metric` (tasks/metric.py) says how its evaluations are judged.
"""

from phalanx.tasks.base import Task, batch_generator, compute_gradient, flat_params, set_flat_params
from phalanx.tasks.metric import ACCURACY, METRICS, VALIDATION_LOSS, Metric
from phalanx.tasks.registry import DEFAULT_TASK, TASKS, register_task, resolve_task

__all__ = [
    "ACCURACY",
    "DEFAULT_TASK",
    "METRICS",
    "TASKS",
    "VALIDATION_LOSS",
    "Metric",
    "Task",
    "batch_generator",
    "compute_gradient",
    "flat_params",
    "register_task",
    "resolve_task",
    "set_flat_params",
]
