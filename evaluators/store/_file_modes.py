"""The store's files (the SQLite database, the hash key) are its owner's alone: a new one
is made with mode 0600; one that exists keeps its mode, the operator's to set, and one
others can read or write is logged at start, as ssh does for a private key, so a store
made by an older release (0644 under the usual umask) does not go unnoticed."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

__all__ = ["private_new_file", "warn_if_shared"]

log = logging.getLogger("understudy.store")


def private_new_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 unless something is there already (an empty
    file is a new database to SQLite)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:  # there already, or not to be made here: SQLite opens it or says why not
        pass


def warn_if_shared(path: Path, holds: str) -> None:
    """Log that ``path`` (which holds ``holds``) is open to others than its owner."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:  # not there (yet): a new file is made 0600
        return
    if mode & 0o077:
        log.warning("store: %s holds %s and others than its owner can read or write it "
                    "(mode %03o): chmod 600 it", path, holds, mode)
