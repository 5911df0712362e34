"""Moving retained KV blocks between engine nodes over TCP (NIXL's job, on loopback).

Rules
-----
1. A node that retains KV (prefill, decode) listens on a KV port.  A pull is one connection:
   PULL, then the owner's BEGIN, BLOCK..., END -- or ERROR (frames in ``_wire``).
2. The owner copies blocks out of a leased retained set in a worker thread, at most
   ``EXPORT_BATCH_BLOCKS`` at a time, while its engine keeps stepping (a retained block never
   changes, see ``_retention``): a pull never waits for a long prefill step on the owner.  It
   writes blocks as they come and drains between frames.  The puller imports on its own
   engine thread, between two of its steps.
3. The puller trusts nothing it has not checked: every frame's checksum, the layout and count
   in BEGIN, that the hashes are exactly those of its own prompt at those positions (the
   chained hash covers every earlier token, so an equal hash is an equal prefix), and -- as the
   pool imports them -- each block's hash against its tokens and its values being finite.
   Any failure is a ``KVTransferError`` with a bounded outcome, and the caller recomputes: a
   failed or expired transfer is slower, never wrong.
4. Every pull is bounded in time (``DEFAULT_PULL_TIMEOUT_S``, connect included) and in size
   (the count the puller asked for).  The owner bounds it too: a connection gets
   ``SERVE_REQUEST_TIMEOUT_S`` to send its PULL and ``SERVE_PULL_TIMEOUT_S`` to take the whole
   answer; one that stops reading (a stopped or wedged puller) is then cut -- aborted, since a
   close would wait to flush what it never reads -- and counted
   (``understudy_kv_serves_cut_total``), so it holds no copied blocks and no task for ever.
5. An owner that is stopping (``drain``) keeps serving until no retained set is left to pull
   and no pull is being answered, at most ``SHUTDOWN_PULL_GRACE_S``: a prefill node stopped
   right after answering still hands that answer's blocks over, so a rolling restart costs no
   decode node a recompute.  Nothing retained, nothing waited for.
6. The owner answers at most ``max_serves`` pull connections at once (each may hold
   ``EXPORT_BATCH_BLOCKS`` copied blocks, ~23 MiB of SmolLM2).  One more is refused at once
   with an ERROR frame (``UNAVAILABLE``), counted (``understudy_kv_serves_refused_total``),
   and closed once the puller has read it (at most ``BUSY_LINGER_S``); its puller fails with
   outcome ``busy`` and recomputes.  The first frame a connection sends is read only up to the
   size of a PULL, so a connection holds no more than that before it is answered or refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..serving._engine import Engine
from ..serving._engine_loop import EngineLoop
from ..serving._metrics import EngineMetrics, PullOutcome
from ._blockpool import BlockHash, KVBlock, NoFreeBlocksError
from ._paged_codec import PagedCodec
from ._retention import TICKET_BYTES, RetainedKV, UnknownTicketError
from ._store import KVLayout
from ._wire import (
    HASH_BYTES,
    PULL_BYTES,
    ErrorCode,
    Frame,
    FrameKind,
    KVWireError,
    PullRequest,
    decode_begin,
    decode_block,
    decode_end,
    decode_error,
    decode_pull,
    encode_begin,
    encode_block,
    encode_end,
    encode_error,
    encode_pull,
    frame_header,
    read_frame,
    write_frame,
)

__all__ = [
    "DEFAULT_MAX_KV_SERVES",
    "DEFAULT_PULL_TIMEOUT_S",
    "EXPORT_BATCH_BLOCKS",
    "SHUTDOWN_PULL_GRACE_S",
    "KVSource",
    "KVTransferError",
    "KVTransferServer",
    "TransferFault",
    "pull_blocks",
    "pull_missing_blocks",
]

log = logging.getLogger(__name__)

DEFAULT_PULL_TIMEOUT_S = 10.0
# A connection that has not sent its PULL by then is closed.
SERVE_REQUEST_TIMEOUT_S = 5.0
# A pull not taken whole by then is cut (rule 4): its puller gave up at DEFAULT_PULL_TIMEOUT_S.
SERVE_PULL_TIMEOUT_S = DEFAULT_PULL_TIMEOUT_S
EXPORT_BATCH_BLOCKS = 32
# A stopping owner serves its retained sets this long at most (rule 5): the router sends the
# decode node on at once, whose pull is itself bounded by DEFAULT_PULL_TIMEOUT_S.
SHUTDOWN_PULL_GRACE_S = DEFAULT_PULL_TIMEOUT_S
_DRAIN_POLL_S = 0.05
# Pull connections an owner answers at once (rule 6); a decode or prefill node has a few peers.
DEFAULT_MAX_KV_SERVES = 16
# A refused connection is closed once its puller has read the refusal, or after this: closing
# with its PULL unread would reset the connection and lose the ERROR frame on the way.
BUSY_LINGER_S = 1.0
# The puller's stream buffer: a few blocks, so the socket is read in large pieces.
_READ_BUFFER_BYTES = 4 * 1024 * 1024
# Fault injection for tests: corrupt one block's bytes after its checksum, or hang up midway.
TransferFault = Literal["corrupt", "drop"]


class KVTransferError(Exception):
    """A pull that did not deliver; ``outcome`` says why (a metric label)."""

    def __init__(self, outcome: PullOutcome, message: str) -> None:
        super().__init__(message)
        self.outcome: PullOutcome = outcome


@dataclass(frozen=True, slots=True)
class KVSource:
    """Where retained blocks wait: the owner's KV endpoint, the ticket, the set's extent.

    On the wire (``kv_transfer_params`` of an OpenAI body) it is plain JSON with hex bytes.
    """

    host: str
    port: int
    ticket: bytes
    num_blocks: int
    last_block_hash: BlockHash

    @classmethod
    def retained_at(cls, host: str, port: int, retained: RetainedKV) -> KVSource:
        return cls(host, port, retained.ticket, retained.num_blocks, retained.last_block_hash)

    def to_params(self, expires_in_s: float | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "remote_host": self.host,
            "remote_port": self.port,
            "ticket": self.ticket.hex(),
            "num_blocks": self.num_blocks,
            "last_block_hash": self.last_block_hash.hex(),
        }
        if expires_in_s is not None:
            params["expires_in_s"] = expires_in_s
        return params

    @classmethod
    def from_params(cls, params: object) -> KVSource:
        """Parse ``kv_transfer_params``; ``ValueError`` with the reason if malformed."""
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        try:
            host, port = params["remote_host"], params["remote_port"]
            ticket = bytes.fromhex(params["ticket"])
            last = bytes.fromhex(params["last_block_hash"])
            num_blocks = params["num_blocks"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"kv_transfer_params: missing or malformed {exc}") from None
        if not isinstance(host, str) or not _is_int(port) or not 0 < port < 65536:
            raise ValueError("kv_transfer_params: remote_host must be a string, remote_port a port")
        if not _is_int(num_blocks) or num_blocks < 1:
            raise ValueError("kv_transfer_params: num_blocks must be a positive integer")
        if len(ticket) != TICKET_BYTES or len(last) != HASH_BYTES:
            raise ValueError("kv_transfer_params: ticket or last_block_hash has the wrong length")
        return cls(host, port, ticket, num_blocks, last)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the owner's side ------------------------------------------------------------------------


class KVTransferServer:
    """Serves the retained blocks of one engine loop to pulling nodes."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        metrics: EngineMetrics,
        *,
        fingerprint: bytes,
        numerics: bytes | None = None,
        codec: bytes | None = None,
        max_serves: int = DEFAULT_MAX_KV_SERVES,
    ) -> None:
        """``fingerprint``: the model's; ``numerics``: the bits' (default: the engine model's
        ``Numerics.fingerprint``); ``codec``: the KV codec's (default: the engine's).  A pull
        must match all three.  ``max_serves``: connections answered at once (rule 6)."""
        if max_serves < 1:
            raise ValueError(f"max_serves must be at least 1, not {max_serves}")
        self._loop = engine_loop
        self._max_serves = max_serves
        self._metrics = metrics
        self._fingerprint = fingerprint
        self._numerics = (
            engine_loop.engine.model.numerics.fingerprint if numerics is None else numerics
        )
        self._codec = engine_loop.engine.kv_codec_fingerprint if codec is None else codec
        self._layout: KVLayout = engine_loop.engine.pool.layout
        self._server: asyncio.Server | None = None
        self._serving = 0  # connections being answered
        self.fault: TransferFault | None = None
        self.host = ""
        self.port = 0

    @property
    def serving(self) -> int:
        """Pull connections being answered now (at most ``max_serves``, rule 6)."""
        return self._serving

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port)
        sockname = self._server.sockets[0].getsockname()
        self.host, self.port = str(sockname[0]), int(sockname[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def drain(self, grace_s: float = SHUTDOWN_PULL_GRACE_S) -> int:
        """Keep serving until no retained set is left and no pull is being answered, or
        ``grace_s`` passes (rule 5); how many sets were still retained (0: all pulled or
        expired).  The engine must be running: it drops expired and released sets."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._loop.alive:
            left = await self._loop.call(_live_sets)
            if not left and not self._serving:
                return 0
            if loop.time() >= deadline:
                log.warning(
                    "KV server closing with %d retained set(s) not pulled within %s s",
                    left,
                    grace_s,
                )
                return left
            await asyncio.sleep(_DRAIN_POLL_S)
        return 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._serving >= self._max_serves:
            await self._refuse_busy(reader, writer)
            return
        self._serving += 1
        try:
            try:
                async with asyncio.timeout(SERVE_REQUEST_TIMEOUT_S):
                    frame = await read_frame(reader, max_length=PULL_BYTES)
            except TimeoutError:
                log.info("KV pull connection closed: no PULL within %s s", SERVE_REQUEST_TIMEOUT_S)
                return
            try:
                async with asyncio.timeout(SERVE_PULL_TIMEOUT_S):
                    served = await self._answer(writer, frame)
            except TimeoutError:
                writer.transport.abort()  # rule 4: close() would wait for the puller to read
                self._metrics.serves_cut.inc()
                log.warning("KV pull cut: not taken within %s s", SERVE_PULL_TIMEOUT_S)
                return
            if served is not None and served.release_after:
                await self._loop.call(lambda engine: engine.release_retained(served.ticket))
        except (KVWireError, asyncio.IncompleteReadError, OSError) as exc:
            log.info("KV pull connection dropped: %s", exc)
        finally:
            self._serving -= 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _refuse_busy(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Rule 6: an ERROR frame, then the connection closed once the puller has read it."""
        self._metrics.serves_refused.inc()
        # Counted; logged quietly: a flood must not flood the log too.
        log.info("KV pull refused: %d pulls being answered (--kv-max-serves)", self._serving)
        message = (
            f"this node is answering {self._serving} KV pulls, its bound (--kv-max-serves); "
            "try again later or recompute"
        )
        try:
            write_frame(writer, FrameKind.ERROR, encode_error(ErrorCode.UNAVAILABLE, message))
            async with asyncio.timeout(BUSY_LINGER_S):
                await writer.drain()
                while await reader.read(PULL_BYTES):  # its PULL, unread: then its hang-up
                    pass
        except (TimeoutError, OSError):
            writer.transport.abort()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer(self, writer: asyncio.StreamWriter, frame: Frame) -> PullRequest | None:
        """Serve one PULL; the pull if it was served whole, None if refused."""
        try:
            if frame.kind is not FrameKind.PULL:
                raise _Refusal(ErrorCode.BAD_REQUEST, f"expected PULL, got {frame.kind.name}")
            pull = decode_pull(frame)
            await self._send(writer, pull)
        except _Refusal as refusal:
            write_frame(writer, FrameKind.ERROR, encode_error(refusal.code, str(refusal)))
            with contextlib.suppress(OSError):
                await writer.drain()
            return None
        return pull

    async def _send(self, writer: asyncio.StreamWriter, pull: PullRequest) -> None:
        if pull.fingerprint != self._fingerprint:
            raise _Refusal(ErrorCode.MODEL_MISMATCH, "the blocks belong to another model")
        if pull.numerics != self._numerics:
            raise _Refusal(
                ErrorCode.NUMERICS_MISMATCH,
                "the blocks were computed with other bits (BLAS kernel, threads or numpy "
                "differ; see the 'engine numerics' log line of each node)",
            )
        if pull.codec != self._codec:
            raise _Refusal(
                ErrorCode.CODEC_MISMATCH,
                f"the blocks are stored by another KV codec (this node: "
                f"{self._loop.engine.kv_codec}); nodes exchange blocks of one codec only",
            )
        first = await self._export(pull.ticket, pull.start, min(pull.count, EXPORT_BATCH_BLOCKS))
        write_frame(writer, FrameKind.BEGIN, encode_begin(self._layout, pull.count))
        sent = 0
        batch = first
        while True:
            for block in batch:
                self._write_block(writer, block, sent)
                sent += 1
                await writer.drain()
            if sent >= pull.count:
                break
            size = min(pull.count - sent, EXPORT_BATCH_BLOCKS)
            batch = await self._export(pull.ticket, pull.start + sent, size)
        write_frame(writer, FrameKind.END, encode_end(sent))
        await writer.drain()
        self._metrics.served_blocks.inc(sent)

    async def _export(self, ticket: bytes, start: int, count: int) -> list[KVBlock]:
        # Off the engine thread: a pull never waits for the owner's step (``_retention``).
        retention = self._loop.engine.retention
        try:
            return await asyncio.to_thread(retention.export, ticket, start, count)
        except UnknownTicketError:
            raise _Refusal(ErrorCode.UNKNOWN_TICKET, "no such retained KV (expired?)") from None
        except IndexError as exc:
            raise _Refusal(ErrorCode.BAD_RANGE, str(exc)) from None

    def _write_block(self, writer: asyncio.StreamWriter, block: KVBlock, index: int) -> None:
        payload = encode_block(block)
        if self.fault == "drop" and index == 1:
            raise ConnectionAbortedError("fault injection: dropped mid-transfer")
        if self.fault == "corrupt" and index == 0:
            corrupted = bytearray(payload)
            corrupted[-1] ^= 0x01
            writer.write(frame_header(FrameKind.BLOCK, payload))
            writer.write(bytes(corrupted))
            return
        write_frame(writer, FrameKind.BLOCK, payload)


def _live_sets(engine: Engine) -> int:
    engine.retention.expire()  # lazy otherwise: an idle engine does not step
    return len(engine.retention)


class _Refusal(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- the puller's side -----------------------------------------------------------------------


_ERROR_OUTCOMES: dict[ErrorCode | None, PullOutcome] = {
    ErrorCode.UNKNOWN_TICKET: "unknown_ticket",
    ErrorCode.MODEL_MISMATCH: "mismatch",
    ErrorCode.NUMERICS_MISMATCH: "numerics",
    ErrorCode.CODEC_MISMATCH: "codec",
    ErrorCode.UNAVAILABLE: "busy",
}


async def pull_blocks(
    source: KVSource,
    start: int,
    expected: Sequence[BlockHash],
    *,
    fingerprint: bytes,
    numerics: bytes,
    layout: KVLayout,
    release_after: bool = False,
    timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
    codec: bytes = bytes(HASH_BYTES),
    packed_sizes: tuple[int, ...] | None = None,
) -> tuple[list[KVBlock], int]:
    """Blocks ``start ..`` of ``source``'s set, which must hash to ``expected``; and the bytes
    received.  ``codec``/``packed_sizes``: the puller's KV codec fingerprint and the sizes of
    its packed blocks (None: fp32).  Raises ``KVTransferError``."""
    pull = PullRequest(
        source.ticket, start, len(expected), fingerprint, numerics, release_after, codec
    )
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                source.host, source.port, limit=_READ_BUFFER_BYTES
            )
            try:
                payload, flags = encode_pull(pull)
                write_frame(writer, FrameKind.PULL, payload, flags)
                await writer.drain()
                return await _receive(reader, expected, layout, packed_sizes)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        raise KVTransferError("timeout", f"no complete answer within {timeout_s} s") from None
    except KVWireError as exc:
        raise KVTransferError(exc.reason, str(exc)) from exc
    except asyncio.IncompleteReadError:
        raise KVTransferError("protocol", "the owner hung up mid-transfer") from None
    except OSError as exc:
        raise KVTransferError("connection", f"{type(exc).__name__}: {exc}") from exc


async def _receive(
    reader: asyncio.StreamReader,
    expected: Sequence[BlockHash],
    layout: KVLayout,
    packed_sizes: tuple[int, ...] | None = None,
) -> tuple[list[KVBlock], int]:
    frame = await read_frame(reader)
    if frame.kind is FrameKind.ERROR:
        code, message = decode_error(frame)
        raise KVTransferError(_ERROR_OUTCOMES.get(code, "protocol"), message)
    if frame.kind is not FrameKind.BEGIN:
        raise KVTransferError("protocol", f"expected BEGIN, got {frame.kind.name}")
    their_layout, count = decode_begin(frame)
    if their_layout != layout:
        raise KVTransferError("mismatch", f"KV layout {their_layout} != {layout}")
    if count != len(expected):
        raise KVTransferError("protocol", f"{count} blocks announced, {len(expected)} asked")
    blocks: list[KVBlock] = []
    received = len(frame.payload)
    while True:
        frame = await read_frame(reader)
        received += len(frame.payload)
        if frame.kind is FrameKind.ERROR:
            code, message = decode_error(frame)
            raise KVTransferError(_ERROR_OUTCOMES.get(code, "protocol"), message)
        if frame.kind is FrameKind.END:
            if decode_end(frame) != len(blocks) or len(blocks) != count:
                raise KVTransferError("protocol", "END does not match the blocks sent")
            return blocks, received
        if frame.kind is not FrameKind.BLOCK or len(blocks) >= count:
            raise KVTransferError("protocol", f"unexpected {frame.kind.name} frame")
        block = decode_block(frame, layout, packed_sizes)
        if block.block_hash != expected[len(blocks)]:
            raise KVTransferError("mismatch", f"block {len(blocks)} is not this prompt's")
        blocks.append(block)  # its hash against its tokens: verified by the import


async def pull_missing_blocks(
    engine_loop: EngineLoop,
    metrics: EngineMetrics,
    source: KVSource,
    prompt_hashes: Sequence[BlockHash],
    *,
    min_blocks: int = 0,
    release_after: bool = False,
    timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
) -> int:
    """Make the engine hold ``source``'s blocks of this prompt: pull those its cache lacks
    (if at least ``min_blocks``), import them.  Returns how many blocks were pulled; failures
    are counted and raised."""
    engine = engine_loop.engine
    reusable = min(source.num_blocks, len(prompt_hashes))
    wanted = prompt_hashes[:reusable]
    local = len(await engine_loop.call(lambda e: e.pool.lookup(wanted)))
    if local >= reusable:
        return 0
    if reusable - local < min_blocks:
        metrics.pulled("below_threshold")
        return 0
    started = time.perf_counter()
    try:
        blocks, size = await pull_blocks(
            source,
            local,
            wanted[local:],
            fingerprint=engine.model.fingerprint,
            numerics=engine.model.numerics.fingerprint,
            layout=engine.pool.layout,
            codec=engine.kv_codec_fingerprint,
            packed_sizes=_packed_sizes(engine.pool.codec),
            release_after=release_after,
            timeout_s=timeout_s,
        )
        try:
            await engine_loop.call(lambda e: e.import_kv(blocks, prefix=wanted[:local]))
        except NoFreeBlocksError as exc:
            raise KVTransferError("no_room", str(exc)) from exc
        except ValueError as exc:  # a block whose hash does not match its tokens
            raise KVTransferError("mismatch", str(exc)) from exc
    except KVTransferError as exc:
        metrics.pulled(exc.outcome)
        raise
    metrics.pulled("ok", time.perf_counter() - started, len(blocks), size)
    return len(blocks)


def _packed_sizes(codec: PagedCodec | None) -> tuple[int, ...] | None:
    return None if codec is None else codec.packed_sizes
