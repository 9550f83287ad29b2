"""`settings_command` plus a few plain options that are not settings (output format, waiting),
so commands like `phalanx health --json` keep one settings model for the network flags."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from phalanx.peer.cli_options import settings_command
from phalanx.peer.config import NetworkSettings


def settings_command_with(
    model: type[NetworkSettings], *, exclude: tuple[str, ...] = (), **extra: tuple[Any, Any]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Like `settings_command`, and each `name=(annotation, typer.Option(...))` in `extra` becomes one more
    option, passed to `fn(settings, name=value, ...)`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = settings_command(model, exclude=exclude)(lambda settings: settings)

        def command(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in extra}
            return fn(inner(**kwargs), **values)

        params = list(inspect.signature(inner).parameters.values())
        params += [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
            for name, (annotation, option) in extra.items()
        ]
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__name__ = fn.__name__
        command.__doc__ = fn.__doc__
        return command

    return decorate
