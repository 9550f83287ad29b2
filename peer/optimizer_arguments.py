"""The library's arguments, checked and turned into the plan `phalanx join` would make of its flags: the
swarm's settings are the same, and only what `phalanx join`'s own loop does is refused (`JOIN_ONLY`)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from pydantic import ValidationError

from phalanx.errors import ConfigError
from phalanx.peer.attacks import GRADIENT_ATTACKS
from phalanx.peer.config import PeerConfig, environment_settings, settings_from_arguments
from phalanx.peer.plan import PeerPlan, make_plan

logger = logging.getLogger(__name__)

_CHECKPOINTS = "save opt.state_dict() beside your model's state_dict() and load both back (opt.load_state_dict())"
_TASKS = "your script builds the model and feeds it its data (tasks are `phalanx join --task`'s)"
# Settings of `phalanx join`'s own loop around the optimizer (peer/trainer.py), which a script does itself:
# each with what to do instead. Every other setting of `phalanx join` configures the swarm here too
# (tests/peer/test_optimizer.py checks that each of the trainer's settings is one or the other).
JOIN_ONLY = {
    "task": _TASKS, "task_options": _TASKS, "data_dir": _TASKS, "data_file": _TASKS,
    "device": "move the model to its device before you make its optimizer",
    "batch_size": "give batch_size_per_step= (the samples of one step)",
    "lr": "set it on the optimizer you wrap (e.g. torch.optim.SGD(params, lr=0.1))",
    "momentum": "set it on the optimizer you wrap (e.g. torch.optim.SGD(params, lr=0.1, momentum=0.9))",
    "weight_decay": "set it on the optimizer you wrap (e.g. torch.optim.AdamW(params, weight_decay=0.01))",
    "steps": "end your loop after as many steps",
    "target_accuracy": "evaluate in your loop and end it there",
    "target_loss": "evaluate in your loop and end it there",
    "eval_every": "evaluate in your loop as often as you like",
    "checkpoint_dir": _CHECKPOINTS, "checkpoint_every": _CHECKPOINTS, "checkpoint_keep": _CHECKPOINTS, "resume": _CHECKPOINTS,
    "torch_threads": "call torch.set_num_threads() in your script",
    "events": "read opt.statistics() in your loop",
    "slowdown": "sleep in your loop (a straggler for demos and tests)",
}  # fmt: skip


def check_arguments(
    batch_size_per_step: Any, target_batch_size: Any, verify: bool, public: dict[str, Optional[Callable[..., Any]]]
) -> None:
    """The batch sizes, and with verify what validators need (`public`: model, batch_fn and loss_fn)."""
    if not isinstance(batch_size_per_step, int) or batch_size_per_step < 1:
        raise ConfigError(
            f"phalanx.Optimizer(batch_size_per_step={batch_size_per_step!r}): give the samples of one step, ≥ 1"
        )
    if target_batch_size is not None and (
        not isinstance(target_batch_size, int) or target_batch_size < batch_size_per_step
    ):
        raise ConfigError(
            f"phalanx.Optimizer(target_batch_size={target_batch_size!r}): give the samples of one global step, "
            f"≥ batch_size_per_step ({batch_size_per_step}), or None for a round every step"
        )
    if not verify:
        return
    missing = [name for name, value in public.items() if value is None]
    if missing:
        raise ConfigError(
            "phalanx.Optimizer(verify=True): validators recompute a peer's gradient from its public batch; "
            f"pass {', '.join(missing)} (model, batch_fn(seed, peer_id, step) -> batch, loss_fn(model, batch) -> loss)"
        )
    if target_batch_size is not None:
        raise ConfigError(
            "phalanx.Optimizer(verify=True, target_batch_size=...): validators recompute one public batch "
            "per global step; drop target_batch_size (or make the batch bigger)"
        )


def refuse_join_settings(settings: dict[str, Any]) -> None:
    """One line for the first setting only `phalanx join`'s loop uses (JOIN_ONLY, and its gradient
    attacks, which it applies to the gradients it computes): here it would do nothing."""
    for name, value in settings.items():
        if name in JOIN_ONLY:
            raise ConfigError(f"phalanx.Optimizer({name}={value!r}): only phalanx join uses it; {JOIN_ONLY[name]}")
        if name == "attack" and isinstance(value, str) and value.partition(":")[0] in GRADIENT_ATTACKS:
            raise ConfigError(
                f"phalanx.Optimizer(attack={value!r}): only phalanx join uses gradient attacks; change the "
                "gradients in your own loop before opt.step()"
            )


def make_inner(optimizer: Any, params: Optional[Iterable[torch.Tensor]]) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        if params is not None:
            raise ConfigError(
                "phalanx.Optimizer: give params only with an optimizer factory; this optimizer has its own"
            )
        return optimizer
    if not callable(optimizer):
        raise ConfigError(
            f"phalanx.Optimizer(optimizer={type(optimizer).__name__}): give a torch.optim.Optimizer or a factory "
            "called with params (e.g. lambda params: torch.optim.AdamW(params, lr=3e-4))"
        )
    if params is None:
        raise ConfigError("phalanx.Optimizer: an optimizer factory needs params=model.parameters()")
    inner = optimizer(params)
    if not isinstance(inner, torch.optim.Optimizer):
        raise ConfigError(
            f"phalanx.Optimizer: the factory returned {type(inner).__name__}, not a torch.optim.Optimizer"
        )
    return inner


def plan_for(
    inner: torch.optim.Optimizer,
    run_id: str,
    mode: str,
    batch_size: int,
    target: Optional[int],
    seed: int,
    verify: bool,
    settings: dict[str, Any],
) -> PeerPlan:
    """The plan of `phalanx join` for these settings; its task name fingerprints what peers must share
    that a task would have fixed: parameter shapes, the optimizer and its hyperparameters, the target."""
    fields = {**settings, "run_id": run_id, "mode": mode, "batch_size": batch_size, "seed": seed, "verify": verify}
    fields["task"] = _fingerprint(inner, target)
    ignored = environment_settings()
    if ignored:
        logger.warning(
            f"phalanx.Optimizer ignores {', '.join(ignored)}: PHALANX_* variables configure the phalanx command; "
            "give a script's settings as arguments"
        )
    try:
        config = settings_from_arguments(PeerConfig, fields)
    except ValidationError as e:
        first = e.errors()[0]
        message = _as_arguments(first["msg"].removeprefix("Value error, "))
        where = f"({first['loc'][0]}={first.get('input')!r})" if first["loc"] else ""  # a rule across settings
        unknown = first["type"] == "extra_forbidden"
        raise ConfigError(
            f"phalanx.Optimizer{where}: "
            + ("no such setting; settings are phalanx join's flags with underscores" if unknown else message)
        ) from None
    try:
        return make_plan(config)
    except ConfigError as e:
        raise ConfigError(f"phalanx.Optimizer: {_as_arguments(str(e))}") from None


def _fingerprint(inner: torch.optim.Optimizer, target: Optional[int]) -> str:
    groups = []
    for g in inner.param_groups:
        shapes = [[list(p.shape), str(p.dtype)] for p in g["params"]]
        hyper = {
            k: (v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
            for k, v in g.items()
            if k != "params"
        }
        groups.append({"shapes": shapes, "hyper": hyper})
    spec = {"optimizer": type(inner).__qualname__, "groups": groups, "target_batch_size": target}
    return "phalanx.Optimizer:" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _as_arguments(message: str) -> str:
    """phalanx join's error messages name flags; here they name the arguments (`--tau` → `tau=`)."""
    return re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_") + "=", message)
