"""The deployment's key for hashing what must not be stored in clear (DESIGN.md, security
defaults: "never store a raw session identifier").

Rules:
1. Session keys (a session header, or the body's ``user``, often an e-mail) are stored as
   ``k:`` + HMAC-SHA256(key, session key), and prompt hashes are HMAC-SHA256(key, body):
   equal values still group together, but a stored value cannot be reversed by hashing
   guesses without the key. ``store_session_keys = true`` stores session keys in clear.
2. The key is ``[evaluation.store] hash_key`` (env ``UNDERSTUDY_EVALUATION__STORE__
   HASH_KEY``) when given; otherwise it is read from ``hash_key_file``, by default
   ``$XDG_STATE_HOME/understudy/hash.key`` (``~/.local/state/understudy/hash.key``),
   which is created (32 random bytes, hex, mode 0600) at the writer's start when absent.
   Replicas that share a store must share the key (give it in config, or share the file)
   or their hashes of one session differ. A key file others can read or write is logged
   (``_file_modes``): with the key, anyone can test guesses against the stored hashes.
3. A key file that cannot be read or created is logged and replaced by a random key for
   this process: hashes then do not match across restarts, but nothing is stored in clear.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from evaluators.store._config import StoreConfig
from evaluators.store._file_modes import warn_if_shared

__all__ = ["default_hash_key_file", "keyed_digest", "load_hash_key"]

log = logging.getLogger("understudy.store")

HASH_KEY_BYTES = 32
SESSION_KEY_PREFIX = "k:"


def default_hash_key_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "understudy" / "hash.key"


def keyed_digest(key: bytes, value: bytes) -> str:
    return hmac.new(key, value, hashlib.sha256).hexdigest()


def load_hash_key(config: StoreConfig) -> bytes:
    """Rule 2: the configured key, or the key file's, created when absent."""
    if config.hash_key is not None:
        return config.hash_key.get_secret_value().encode()
    path = config.hash_key_file or default_hash_key_file()
    try:
        return _read_or_create(path)
    except OSError as exc:
        log.error("store: cannot read or create the hash key file %s (%s): hashing with a "
                  "key for this process only", path, exc.strerror or exc)
        return secrets.token_bytes(HASH_KEY_BYTES)


def _read_or_create(path: Path) -> bytes:
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        pass
    else:
        if key:
            warn_if_shared(path, "the key of the stored session hashes")
            return key
        raise OSError(f"{path} is empty")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_hex(HASH_KEY_BYTES).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another replica made it first: use theirs
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as fh:
        fh.write(key + b"\n")
    log.info("store: created the hash key file %s (share it with every replica)", path)
    return key
