"""The store's errors, and the one place SQLAlchemy's and the drivers' errors become them.

    StoreError                  anything the store could not do
    ├── StoreUnavailable        transient: the database is unreachable, the connection was
    │                           lost, a timeout; the writer retries these with backoff
    ├── StoreRejected           the database refused the data or the statement (integrity,
    │                           data, programming errors); retrying the same rows cannot help
    ├── UnknownRevision         a migration target that names no revision, or none reachable
    │                           from where the schema stands (``db upgrade --revision``)
    └── WriterStateError        a ScoreWriter used outside its lifecycle (started twice, ...)

Whatever the driver (asyncpg, aiosqlite), callers see only these, raised ``from`` the
original so the cause stays in the traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import exc as sa_exc

__all__ = [
    "StoreError",
    "StoreRejected",
    "StoreUnavailable",
    "UnknownRevision",
    "WriterStateError",
    "translate_store_errors",
]


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    """The database cannot be reached right now; the same work may succeed later."""


class StoreRejected(StoreError):
    """The database refused this work; repeating it unchanged would fail again."""


class UnknownRevision(StoreError):
    """A migration was asked for a revision it cannot reach (a typo, ``head+1``, an
    upgrade to an older revision): the caller's argument, not the database, is wrong."""


class WriterStateError(StoreError):
    """A ScoreWriter was used in a state that does not allow it."""


TRANSIENT_SQLSTATE_CLASSES = ("08", "40", "53", "57")
"""PostgreSQL error classes (the SQLSTATE's first two characters) that say the server is
away or busy, not that it refuses the work: connection exceptions, transaction rollbacks
(a serialization failure, a deadlock), insufficient resources (too many clients, a full
disk), operator intervention (the server shutting down or starting up, a backend
terminated, a statement cancelled). asyncpg's errors for these reach SQLAlchemy as its
generic ``Error``, neither an OperationalError nor a lost connection, so they are told
apart by their code: a restart's "the database system is shutting down" (57P03) is then
retried instead of rejecting (and splitting, and dropping) the batch in hand."""


def is_transient(exc: BaseException) -> bool:
    """True for errors that a retry against a recovered database can cure."""
    if isinstance(exc, sa_exc.DBAPIError):
        return exc.connection_invalidated or isinstance(
            exc, sa_exc.OperationalError | sa_exc.InterfaceError
        ) or _has_transient_sqlstate(exc.orig)
    return isinstance(
        exc, OSError | TimeoutError | sa_exc.TimeoutError
        | sa_exc.DisconnectionError | sa_exc.ResourceClosedError
    ) or _is_driver_connection_error(exc) or _has_transient_sqlstate(exc)


def _has_transient_sqlstate(exc: BaseException | None) -> bool:
    sqlstate = getattr(exc, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith(TRANSIENT_SQLSTATE_CLASSES)


def _is_driver_connection_error(exc: BaseException) -> bool:
    # asyncpg raises its own connection errors from connect() before SQLAlchemy wraps
    # anything; they are named, not imported, so this module does not need asyncpg.
    return type(exc).__name__ in {
        "ConnectionDoesNotExistError",
        "ConnectionFailureError",
        "CannotConnectNowError",
        "TooManyConnectionsError",
        "InterfaceError",
    }


@contextmanager
def translate_store_errors() -> Iterator[None]:
    """Re-raise SQLAlchemy and driver errors as :class:`StoreError` subclasses."""
    try:
        yield
    except StoreError:
        raise
    except (sa_exc.SQLAlchemyError, OSError, TimeoutError) as exc:
        if is_transient(exc):
            raise StoreUnavailable(_describe(exc)) from exc
        raise StoreRejected(_describe(exc)) from exc
    except OverflowError as exc:  # a value SQLite's driver cannot bind (past 64 bits),
        # raised unwrapped: rejected as PostgreSQL's out-of-range error is, so the writer
        # drops that record alone rather than its whole batch
        raise StoreRejected(_describe(exc)) from exc
    except Exception as exc:
        if _is_driver_connection_error(exc):
            raise StoreUnavailable(_describe(exc)) from exc
        raise


def _describe(exc: BaseException) -> str:
    """One line: the error's type and the first line of its message (no SQL, no params)."""
    original = getattr(exc, "orig", None) or exc
    message = str(original).strip().splitlines()
    return f"{type(original).__name__}: {message[0] if message else ''}"[:300]
