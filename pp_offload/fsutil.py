"""Filesystem steps shared by checkpoints and exports: never leave a half-written directory in place.

Why: a job killed while saving must not destroy the last good checkpoint or export. Writers fill a
``<name>.partial`` directory next to the target; only when it is complete does it replace the target, and
the previous version is removed only after the new one is in place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["partial_dir", "publish_dir", "write_text_atomic"]


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


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
