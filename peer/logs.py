"""Logging set up once by the CLI: human-readable text or one JSON object per line."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import logging
import sys
import time

_FORMATS = ("text", "json")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(fmt: str = "text", *, debug: bool = False) -> None:
    """Route every logger (ours and hivemind's) to stderr in one format."""
    if fmt not in _FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(_FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S")
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    # multiaddr logs two lines of its parser's internals for every peer ID it reads: noise under --debug
    logging.getLogger("multiaddr").setLevel(logging.INFO)
    # hivemind installs its own handler (and level) on import; route it through ours so --log-format
    # holds everywhere, but only once something imports it (importing it here costs seconds of --help).
    route = functools.partial(_route_hivemind_logs, logging.DEBUG if debug else logging.WARNING)
    for finder in [f for f in sys.meta_path if isinstance(f, _AfterImport)]:
        sys.meta_path.remove(finder)
    if "hivemind" in sys.modules:
        route()
    else:
        sys.meta_path.insert(0, _AfterImport("hivemind", route))


def _route_hivemind_logs(level: int) -> None:
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(level)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `hook` right after the module `name` is first imported, then removes itself."""

    def __init__(self, name: str, hook) -> None:
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hook(module) -> None:
            exec_module(module)
            self.hook()

        spec.loader.exec_module = exec_then_hook  # type: ignore[method-assign]
        return spec
