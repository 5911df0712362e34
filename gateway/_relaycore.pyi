"""Types of the C extension ``gateway._relaycore`` (gateway/_relaycore.c)."""

import asyncio
from collections.abc import Callable
from typing import Any

class BodyFraming:
    on_piece: Callable[[bytes], None] | None
    last_read: float
    _time: Callable[[], float]
    _buf: bytes
    _remaining: int
    _framing: int
    _chunk_state: int
    _keep_alive: bool
    _in_body: bool
    def data_received(self, data: bytes) -> None: ...
    def body_received(self, data: bytes) -> None: ...

class Tee:
    _conn: Any
    _out: Any
    _filter: Any
    paused: bool
    waiter: asyncio.Future[None] | None
    def __init__(self, conn: BodyFraming, capture_add: Callable[[float, bytes], None],
                 out: Any, chunk_filter: Any, capture: Any = None) -> None: ...
    def __call__(self, piece: bytes) -> None: ...
    def piece(self, piece: bytes) -> None: ...

class SseFilter:
    _pending: bytes
    _held: list[bytes]
    _done: bool
    _skip_lf: bool
    @property
    def max_event_bytes(self) -> int: ...
    @property
    def oversized(self) -> int: ...
    @property
    def _scanned(self) -> int: ...
    def __init__(self, max_event_bytes: int) -> None: ...
    def feed(self, chunk: bytes) -> bytes: ...

class ClientSink:
    _transport: asyncio.Transport
    _protocol: Any
    _held: list[bytes] | None
    _held_bytes: int
    _chunked: bool
    def __init__(self, transport: asyncio.Transport, protocol: Any, chunked: bool,
                 max_held: int) -> None: ...
    def write(self, piece: bytes) -> bool: ...
