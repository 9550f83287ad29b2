"""Logging set up once by the CLI: human-readable text or one JSON object per line."""

from __future__ import annotations

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
    # hivemind installs its own handler on import; route it through ours so --log-format holds everywhere.
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(logging.DEBUG if debug else logging.WARNING)
