"""Filesystem steps shared by checkpoints and exports: never leave a half-written directory in place.

Why: a job killed while saving must not destroy the last good checkpoint or export. Writers fill a
``<name>.partial`` directory next to the target; only when it is complete does it replace the target, and
the previous version is removed only after the new one is in place.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["partial_dir", "publish_dir", "publish_once", "write_text_atomic"]


def partial_dir(final: Path) -> Path:
    """The scratch directory that becomes ``final`` once complete."""
    return final.with_name(final.name + ".partial")


def publish_dir(partial: Path, final: Path) -> None:
    """Move the complete ``partial`` directory to ``final``, replacing what was there.

    A crash at any point leaves either the old or the new version under ``final`` (or, between the two
    renames, the old one under ``final.old``): nothing is deleted before its replacement exists.
    """
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(partial, final)
    if old.exists():
        shutil.rmtree(old)


def publish_once(tmp: Path, final: Path, is_complete: Callable[[Path], bool]) -> None:
    """Rename the finished build ``tmp`` to ``final``, for builds that several processes may make at once
    with the same content (each rank building a shared cache before any process group exists): losing the
    race to an identical build is success. Whatever else sits under ``final`` (``is_complete`` says no: a
    broken or outdated build) is first moved aside atomically, so no reader sees it half-deleted."""
    if final.exists() and not is_complete(final):
        trash = final.with_name(f".{final.name}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(final, trash)
        except FileNotFoundError:  # another process moved it first
            pass
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        # The target exists and is not empty: another process published first. Its build is identical.
        if not is_complete(final):
            raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
