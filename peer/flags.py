"""Turn a settings model's fields into typer options, so flags, env vars and the config file
share one definition (name, type, default, help) and cannot drift apart."""

from __future__ import annotations

import inspect
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from pydantic.fields import FieldInfo
from typer.core import TyperCommand

from phalanx.errors import ConfigError
from phalanx.peer.config import NetworkSettings, load_settings, misspelt_env_vars


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option_type(annotation: Any) -> tuple[Any, bool]:
    """(typer-friendly type, is_bool) for a pydantic field annotation."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _option_type(args[0])
    if origin is typing.Annotated:
        return _option_type(args[0])
    if origin is list:
        return list[str], False
    if origin is typing.Literal:
        return str, False
    if annotation is bool:
        return bool, True
    if annotation in (int, float, str, Path):
        return annotation, False
    return str, False


class PlainHelp(TyperCommand):
    """click's plain --help layout for the commands with many settings: at 80 columns rich's option table
    cut long names and left the help a narrow column; here a long name takes its own line instead."""

    def format_help(self, ctx, formatter) -> None:
        self.rich_markup_mode = None
        paragraphs = inspect.cleandoc(re.sub(r"\[/?bold\]", "", self.help or "")).split("\n\n")
        # indented paragraphs are example commands: keep their lines as written (click's \b marker)
        self.help = "\n\n".join("\b\n" + p if p.startswith(" ") else p for p in paragraphs)
        super().format_help(ctx, formatter)


def _help(name: str, info: FieldInfo) -> str:
    text = info.description or ""
    origin = typing.get_origin(info.annotation)
    if origin is typing.Literal:
        text += f" One of: {', '.join(map(str, typing.get_args(info.annotation)))}."
    default = info.get_default(call_default_factory=True)
    if default not in (None, [], ""):
        text += f" [default: {default}]"
    return f"{text} [env: PHALANX_{name.upper()}]"


def settings_command(
    model: type[NetworkSettings], *, exclude: tuple[str, ...] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate `fn(settings)`: the command gets one option per model field plus --config, and `fn`
    receives the validated settings (flag > PHALANX_* env > --config TOML file > default)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = [
            inspect.Parameter(
                "config_file",
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(None, "--config", help="TOML file with any of these settings (flags win)."),
                annotation=Optional[Path],
            )
        ]
        names = []
        for name, info in model.model_fields.items():
            if name in exclude:
                continue
            typ, is_bool = _option_type(info.annotation)
            # a --no-X switch only where X is on by default: the others would double the width of --help
            negatable = is_bool and info.get_default() is True
            decls = [f"{_flag(name)}/--no-{name.replace('_', '-')}"] if negatable else [_flag(name)]
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=typer.Option(None, *decls, help=_help(name, info), show_default=False),
                    annotation=Optional[typ],
                )
            )
            names.append(name)

        def settings(**kwargs: Any) -> NetworkSettings:
            config_file = kwargs.pop("config_file", None)
            overrides = {k: v for k, v in kwargs.items() if v is not None and v != []}
            return load_settings(model, overrides, config_file)

        def command(**kwargs: Any) -> Any:
            warn_misspelt_env_vars()
            return fn(settings(**kwargs))

        command.settings = settings  # type: ignore[attr-defined]  # validate flags without running (phalanx swarm)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__name__ = fn.__name__
        command.__doc__ = fn.__doc__
        return command

    return decorate


def settings_command_with(
    model: type[NetworkSettings], *, exclude: tuple[str, ...] = (), **extra: tuple[Any, Any]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Like `settings_command`, and each `name=(annotation, typer.Option(...))` in `extra` becomes one more
    option, passed to `fn(settings, name=value, ...)`: plain options that are not settings (output format,
    waiting), so commands like `phalanx health --json` keep one settings model for the network flags."""

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


def warn_misspelt_env_vars() -> None:
    """One line per PHALANX_* variable that no setting reads (a typo would otherwise go unnoticed)."""
    for name, close in misspelt_env_vars():
        hint = f"did you mean {close}?" if close else "see `phalanx <command> --help` for the [env: ...] names"
        typer.secho(f"warning: {name} is not a Phalanx setting and is ignored ({hint})", err=True, fg="yellow")


def _split_numbers(text: str, flag: str, convert, kind: str) -> list:
    try:
        return [convert(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated {kind}, not {text!r}") from None


def int_list(text: str, flag: str) -> list[int]:
    """`--n 8,16,32` → [8, 16, 32]; one line naming the flag when it is not that."""
    values = _split_numbers(text, flag, lambda x: int(float(x)), "integers like 8,16")
    if not values or min(values) <= 0:
        raise ConfigError(f"{flag} needs at least one positive integer, got {text!r}")
    return values


def float_list(text: str, flag: str) -> list[float]:
    values = _split_numbers(text, flag, float, "numbers like 0,1000")
    if not values or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"{flag} needs at least one finite number, got {text!r}")
    return values


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
