"""Crash-safe checkpoints: `ckpt-{step:09d}.pt` files written atomically, the newest K kept.

A checkpoint is written to a temp file in the same folder, fsynced, renamed into place
and the folder fsynced, so a crash at any moment leaves either the old set of files or
the new one, plus at worst a temp file that `load_latest` ignores and removes. Files are
read with `torch.load(weights_only=True)`: no arbitrary object is ever unpickled.
One process writes a given folder.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import ConfigError

logger = logging.getLogger(__name__)

FORMAT = "phalanx-checkpoint"
VERSION = 1
DEFAULT_KEEP = 3
_NAME = re.compile(r"ckpt-(\d{9,})\.pt")
_TEMP_PREFIX = ".ckpt-"  # temp names: .ckpt-{step:09d}.{pid}.{random}.tmp
_TEMP_SUFFIX = ".tmp"
# What `extra` may hold: what torch.load(weights_only=True) reads back. Exact types, because
# subclasses (numpy scalars are floats, named tuples are tuples) are pickled by class and refused.
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint read back from disk; tensors are on the `map_location` device (CPU by default)."""

    path: Path
    step: int
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    extra: dict[str, Any]


def checkpoint_path(directory: Path | str, step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(directory) / f"ckpt-{step:09d}.pt"


def save_checkpoint(
    directory: Path | str,
    *,
    step: int,
    model_state: Mapping[str, Any],
    optimizer_state: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    keep: int = DEFAULT_KEEP,
) -> Path:
    """Atomically write the checkpoint of `step`, then delete those of higher steps (a state this peer
    left) and all but the newest `keep`; returns its path.

    Pass states that nothing modifies while this runs (e.g. from the training thread between
    steps, or copies). `extra` holds plain values only: str, int, float, bool, None, tensors,
    and lists, tuples and str-keyed dicts of those.
    """
    if keep < 1:
        raise ConfigError(f"checkpoint keep={keep} must be at least 1 (the checkpoint just written)")
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    extra = dict(extra or {})
    _check_plain(extra, "extra")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model": dict(model_state),
        "optimizer": dict(optimizer_state),
        "extra": extra,
    }
    path = checkpoint_path(directory, step)
    fd, temp_name = tempfile.mkstemp(
        dir=directory, prefix=f"{_TEMP_PREFIX}{step:09d}.{os.getpid()}.", suffix=_TEMP_SUFFIX
    )
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(directory)  # the rename itself survives a power cut
    logger.debug("saved checkpoint %s (%.1f MB)", path, path.stat().st_size / 1e6)
    _prune(directory, keep=keep, keep_path=path)
    return path


def load_latest(directory: Path | str, *, map_location: str | torch.device = "cpu") -> Checkpoint | None:
    """The newest checkpoint that reads back whole, or None; unreadable files are skipped with a warning.

    Removes temp files left by crashed writers (never those of this process's own writes).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    _remove_stale_temps(directory)
    for step, path in sorted(_checkpoint_files(directory), reverse=True):
        try:
            return _read(path, step, map_location)
        except Exception as e:  # a damaged file may fail in zip, unpickling or our checks: all mean "skip it"
            logger.warning("skipping unreadable checkpoint %s: %s: %s", path, type(e).__name__, e)
    return None


def _read(path: Path, step: int, map_location: str | torch.device) -> Checkpoint:
    payload = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError("not a Phalanx checkpoint")
    if payload.get("version") != VERSION:
        raise ValueError(f"checkpoint format version {payload.get('version')!r}, this Phalanx reads {VERSION}")
    if payload.get("step") != step:
        raise ValueError(f"holds step {payload.get('step')!r} but is named for step {step}")
    for key in ("model", "optimizer", "extra"):
        if not isinstance(payload.get(key), dict):
            raise ValueError(f"field {key!r} is missing or not a dict")
    return Checkpoint(
        path=path,
        step=step,
        model_state=payload["model"],
        optimizer_state=payload["optimizer"],
        extra=payload["extra"],
    )


def _checkpoint_files(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return found


def _prune(directory: Path, *, keep: int, keep_path: Path) -> None:
    # Runs only after the new file is in place, so a crash here loses nothing. The file just written is
    # the peer's state: files of higher steps belong to a state it left (it trained alone while cut off,
    # then took the swarm's state of a lower step), and `load_latest` would resume from them, so they go.
    step = int(_NAME.fullmatch(keep_path.name).group(1))  # type: ignore[union-attr]
    files = sorted(_checkpoint_files(directory), reverse=True)
    superseded = [path for s, path in files if s > step]
    older = [path for s, path in files if s <= step and path != keep_path][keep - 1 :]
    for path in superseded + older:
        path.unlink(missing_ok=True)
        logger.debug("deleted %s checkpoint %s", "superseded" if path in superseded else "old", path)


def _remove_stale_temps(directory: Path) -> None:
    for path in directory.iterdir():
        name = path.name
        if not (name.startswith(_TEMP_PREFIX) and name.endswith(_TEMP_SUFFIX)):
            continue
        parts = name[len(_TEMP_PREFIX) : -len(_TEMP_SUFFIX)].split(".")  # [step, pid, random]
        if len(parts) == 3 and parts[1] == str(os.getpid()):
            continue  # maybe a save in progress on another thread of this process
        logger.info("removing temp file %s left by an interrupted checkpoint write", path)
        path.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_plain(value: Any, where: str) -> None:
    """Refuse values that torch.load(weights_only=True) would not read back (they would make the file unreadable)."""
    if type(value) in _SCALARS or isinstance(value, torch.Tensor):
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"checkpoint {where} has a non-str key {key!r}; use str keys")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"checkpoint {where} is a {type(value).__name__}; only str, int, float, bool, None, tensors, "
        "lists, tuples and dicts of those can be saved"
    )
