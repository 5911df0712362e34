"""Moving retained KV between two engines over loopback TCP, and every way a pull can fail.

Two ``Engine``s over the session's one model (``engine_model``), each stepped by its own
``EngineLoop``; the owner serves its retained sets with a ``KVTransferServer``, a puller pulls
them with ``pull_missing_blocks``.  A pull either delivers the owner's blocks bit for bit --
and the puller then answers exactly as a fresh engine does -- or fails with one bounded,
counted outcome and imports nothing.  Prompts are a few dozen tokens, answers a few tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import numpy as np
import pytest

from backends.engine import Engine, KVBlock, KVLayout, LlamaModel, SamplingParams, hash_block
from backends.engine.kv import _transfer
from backends.engine.kv._blockpool import BlockHash, NoFreeBlocksError, hash_blocks
from backends.engine.kv._retention import RetainedKV, UnknownTicketError
from backends.engine.kv._transfer import (
    DEFAULT_MAX_KV_SERVES,
    DEFAULT_PULL_TIMEOUT_S,
    KVSource,
    KVTransferError,
    KVTransferServer,
    pull_blocks,
    pull_missing_blocks,
)
from backends.engine.kv._wire import (
    MAGIC,
    FrameKind,
    PullRequest,
    encode_pull,
    read_frame,
    write_frame,
)
from backends.engine.serving._engine_loop import EngineLoop, EngineServerError, EngineStopped
from backends.engine.serving._metrics import PULL_OUTCOMES, EngineMetrics
from tests.utils import eventually, free_port

MODEL_NAME = "m"
KV_LIMIT = 64 << 20
RETAIN_S = 60.0
# 27 tokens: with 6 answer tokens the request computes 32, two full blocks, the second of them
# holding prompt and answer.
PROMPT_TEXT = (
    "A list of colours: red, green, blue, yellow, orange, purple, pink, brown, black, white, grey,"
)
# 33 tokens: two full blocks of prompt, retained by a one-token request; once the module's owner
# has computed it, retaining it again computes one token.
RETAINED_TEXT = (
    "A list of colours: red, green, blue, yellow, orange, purple, pink, brown, black, white, grey,"
    " gold, silver, violet,"
)
OTHER_TEXT = "The harbour has eight piers. Pier one takes small boats, pier two takes ferries. " * 2
ANSWER_TOKENS = 6
FOLLOW_UP_TEXT = " Which of these colours is the darkest?"
SHORT_TIMEOUT_S = 0.3


@dataclass(frozen=True, slots=True)
class Node:
    """An engine, the loop stepping it, and that loop's metrics."""

    engine: Engine
    loop: EngineLoop
    metrics: EngineMetrics

    def sample(self, name: str, **labels: str) -> float:
        labels = {"model_name": MODEL_NAME, "engine": "0", **labels}
        value = self.metrics.registry.get_sample_value(name, labels)
        assert value is not None, f"no series {name} {labels}"
        return value

    def pulls(self) -> dict[str, float]:
        """The pull outcomes counted so far (those above zero)."""
        counts = {o: self.sample("understudy_kv_pulls_total", outcome=o) for o in PULL_OUTCOMES}
        return {outcome: count for outcome, count in counts.items() if count}


@dataclass(frozen=True, slots=True)
class Owner:
    node: Node
    server: KVTransferServer

    def source(self, retained: RetainedKV) -> KVSource:
        return KVSource.retained_at(self.server.host, self.server.port, retained)


@pytest.fixture(scope="module")
def owner_engine(engine_model: LlamaModel) -> Engine:
    """One owner for the module: its prefix cache makes every later retain a short step."""
    return Engine(engine_model, KV_LIMIT)


@pytest.fixture
def prompt(engine_model: LlamaModel) -> list[int]:
    tokens = engine_model.tokenizer.encode(PROMPT_TEXT)
    assert len(tokens) + ANSWER_TOKENS - 1 == 32  # two full blocks once answered
    return tokens


@pytest.fixture
def history(engine_model: LlamaModel) -> list[int]:
    tokens = engine_model.tokenizer.encode(RETAINED_TEXT)
    assert len(tokens) == 33  # two full blocks and the token that gives the logits
    return tokens


@pytest.fixture
async def start_node() -> AsyncIterator[Callable[[Engine], Node]]:
    """Start an ``EngineLoop`` (with its own metrics) over an engine; all stop at teardown."""
    loops: list[EngineLoop] = []

    def start(engine: Engine) -> Node:
        metrics = EngineMetrics(MODEL_NAME)
        loop = EngineLoop(engine, metrics, capacity=4)
        loop.start()
        loops.append(loop)
        return Node(engine, loop, metrics)

    yield start
    for loop in loops:
        await loop.stop(5)


@pytest.fixture
def start_puller(
    engine_model: LlamaModel, start_node: Callable[[Engine], Node]
) -> Callable[[], Node]:
    """A fresh engine (an empty cache) and its loop."""
    return lambda: start_node(Engine(engine_model, KV_LIMIT))


@contextlib.asynccontextmanager
async def serving(
    node: Node,
    *,
    fingerprint: bytes | None = None,
    numerics: bytes | None = None,
    max_serves: int = DEFAULT_MAX_KV_SERVES,
) -> AsyncIterator[Owner]:
    """``node``'s retained sets served on a free KV port until the block ends.  ``fingerprint``
    and ``numerics`` stand in for the node's own (an owner of another model, other bits)."""
    server = KVTransferServer(
        node.loop,
        node.metrics,
        fingerprint=node.engine.model.fingerprint if fingerprint is None else fingerprint,
        numerics=numerics,
        max_serves=max_serves,
    )
    await server.start("127.0.0.1", 0)
    try:
        yield Owner(node, server)
    finally:
        await server.close()


@pytest.fixture
async def owner(owner_engine: Engine, start_node: Callable[[Engine], Node]) -> AsyncIterator[Owner]:
    async with serving(start_node(owner_engine)) as served:
        yield served


async def _run_retaining(
    node: Node, prompt: Sequence[int], max_tokens: int, retain_s: float = RETAIN_S
) -> tuple[RetainedKV, list[int]]:
    """Run a greedy request that retains its KV; what it retained and its answer."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    arrived_at = asyncio.get_running_loop().time()
    handle = node.loop.submit(prompt, params, arrived_at=arrived_at, retain_kv_s=retain_s)
    answer: list[int] = []
    try:
        while True:
            item = await handle.queue.get()
            if isinstance(item, EngineServerError):
                raise item
            answer.extend(event.token_id for event in item)
            if item[-1].finished:
                retained = item[-1].retained
                assert retained is not None, "a finished request with retain_kv_s kept nothing"
                assert not any(event.retained for event in item[:-1])
                return retained, answer
    finally:
        node.loop.release(handle)


async def _retain(node: Node, tokens: Sequence[int], retain_s: float = RETAIN_S) -> RetainedKV:
    """Retain the full blocks of ``tokens`` (a one-token request: little to compute)."""
    retained, _ = await _run_retaining(node, tokens, 1, retain_s)
    assert retained.num_blocks == len(tokens) // node.engine.block_size
    return retained


def _hashes(node: Node, tokens: Sequence[int]) -> list[BlockHash]:
    return hash_blocks(node.engine.pool.seed, tokens, node.engine.block_size)


class PullOptions(TypedDict, total=False):
    """``pull_missing_blocks``'s keywords, typed: a test names only those it sets."""

    min_blocks: int
    release_after: bool
    timeout_s: float


async def _pull(
    puller: Node, source: KVSource, tokens: Sequence[int], **options: Unpack[PullOptions]
) -> int:
    """``pull_missing_blocks`` of ``tokens`` into ``puller``; its own defaults where ``options``
    does not set a keyword."""
    return await pull_missing_blocks(
        puller.loop, puller.metrics, source, _hashes(puller, tokens), **options
    )


async def _pull_fails(
    puller: Node, source: KVSource, tokens: Sequence[int], **options: Unpack[PullOptions]
) -> str:
    """Pull, expecting a failure; its outcome, after checking nothing was imported."""
    with pytest.raises(KVTransferError) as caught:
        await _pull(puller, source, tokens, **options)
    cached = await puller.loop.call(lambda e: e.cached_prefix_blocks(tokens))
    assert cached == [], "a failed pull left blocks in the puller's cache"
    return caught.value.outcome


async def _holds(owner: Owner, ticket: bytes) -> bool:
    def check(engine: Engine) -> bool:
        try:
            engine.export_retained(ticket, 0, 0)
        except UnknownTicketError:
            return False
        return True

    return await owner.node.loop.call(check)


# -- a pull that delivers ---------------------------------------------------------------------


async def test_pulled_blocks_are_the_owners_and_give_the_same_tokens(
    engine_model: LlamaModel, owner: Owner, start_puller: Callable[[], Node], prompt: list[int]
) -> None:
    retained, answer = await _run_retaining(owner.node, prompt, ANSWER_TOKENS)
    assert len(answer) == ANSWER_TOKENS
    assert retained.num_blocks == 2  # prompt and answer, computed: 32 tokens
    conversation = prompt + answer
    next_turn = conversation + engine_model.tokenizer.encode(FOLLOW_UP_TEXT)
    assert retained.last_block_hash == _hashes(owner.node, conversation)[1]

    puller = start_puller()
    assert await _pull(puller, owner.source(retained), next_turn) == 2
    assert puller.pulls() == {"ok": 1}
    assert puller.sample("understudy_kv_pulled_blocks_total") == 2
    block_bytes = puller.engine.pool.layout.bytes_per_block
    assert puller.sample("understudy_kv_pulled_bytes_total") > 2 * block_bytes
    assert owner.node.sample("understudy_kv_served_blocks_total") == 2
    assert await _holds(owner, retained.ticket)  # no release asked for: still there

    theirs = await owner.node.loop.call(lambda e: e.export_retained(retained.ticket, 0, 2))
    ours = await puller.loop.call(lambda e: e.export_kv(next_turn))
    assert len(ours) == 2
    for got, want in zip(ours, theirs, strict=True):
        assert (got.block_hash, got.parent_hash) == (want.block_hash, want.parent_hash)
        assert got.token_ids == want.token_ids
        assert got.data.tobytes() == want.data.tobytes()
    assert [t for block in ours for t in block.token_ids] == conversation[:32]

    # The prefix is local now: nothing more to pull, nothing counted.
    assert await _pull(puller, owner.source(retained), next_turn) == 0
    assert puller.pulls() == {"ok": 1}

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    pulled_answer = await puller.loop.call(lambda e: e.generate(next_turn, params))
    hits = await puller.loop.call(lambda e: e.pool.stats().hits)
    assert hits == 32, "the puller recomputed the prefix instead of reusing the pulled blocks"
    fresh = Engine(engine_model, KV_LIMIT)
    assert pulled_answer == await asyncio.to_thread(fresh.generate, next_turn, params)


async def test_pulling_only_the_blocks_the_puller_lacks(
    owner: Owner, start_puller: Callable[[], Node], history: list[int]
) -> None:
    retained = await _retain(owner.node, history)
    puller = start_puller()
    (first,) = await owner.node.loop.call(lambda e: e.export_retained(retained.ticket, 0, 1))
    await puller.loop.call(lambda e: e.import_kv([first]))
    assert await _pull(puller, owner.source(retained), history) == 1  # the second block only
    assert owner.node.sample("understudy_kv_served_blocks_total") == 1
    assert len(await puller.loop.call(lambda e: e.cached_prefix_blocks(history))) == 2
    # Fewer missing blocks than asked for: not worth a transfer.
    other = start_puller()
    assert await _pull(other, owner.source(retained), history, min_blocks=3) == 0
    assert other.pulls() == {"below_threshold": 1}


async def test_release_after_drops_the_set_on_the_owner(
    owner: Owner, start_puller: Callable[[], Node], history: list[int]
) -> None:
    retained = await _retain(owner.node, history)
    source = owner.source(retained)
    assert await _pull(start_puller(), source, history) == 2
    assert await _holds(owner, retained.ticket)
    releasing = start_puller()
    assert await _pull(releasing, source, history, release_after=True) == 2
    async with asyncio.timeout(5):  # the owner releases after END, on its engine thread
        while await _holds(owner, retained.ticket):  # noqa: ASYNC110 - polling the engine thread
            await asyncio.sleep(0.01)
    late = start_puller()
    assert await _pull_fails(late, source, history) == "unknown_ticket"
    assert (releasing.pulls(), late.pulls()) == ({"ok": 1}, {"unknown_ticket": 1})


# -- pulls that fail --------------------------------------------------------------------------


async def test_an_unknown_ticket(
    owner: Owner, start_puller: Callable[[], Node], history: list[int]
) -> None:
    hashes = _hashes(owner.node, history)
    forged = KVSource(owner.server.host, owner.server.port, secrets.token_bytes(16), 2, hashes[1])
    puller = start_puller()
    assert await _pull_fails(puller, forged, history) == "unknown_ticket"
    assert puller.pulls() == {"unknown_ticket": 1}


async def test_an_expired_ticket(
    owner: Owner, start_puller: Callable[[], Node], history: list[int]
) -> None:
    retained = await _retain(owner.node, history, retain_s=0.05)
    await asyncio.sleep(0.1)
    puller = start_puller()
    assert await _pull_fails(puller, owner.source(retained), history) == "unknown_ticket"
    assert puller.pulls() == {"unknown_ticket": 1}
    assert not await _holds(owner, retained.ticket)


async def test_a_corrupted_block_fails_its_checksum_and_a_retry_succeeds(
    owner: Owner, start_puller: Callable[[], Node], history: list[int]
) -> None:
    retained = await _retain(owner.node, history)
    puller = start_puller()
    owner.server.fault = "corrupt"
    assert await _pull_fails(puller, owner.source(retained), history) == "checksum"
    owner.server.fault = None
    assert await _pull(puller, owner.source(retained), history) == 2  # the set is still there
    assert puller.pulls() == {"checksum": 1, "ok": 1}


async def test_a_transfer_cut_midway_is_a_protocol_failure(
    owner: Owner, start_puller: Callable[[], Node], history: list[int]
) -> None:
    retained = await _retain(owner.node, history)
    puller = start_puller()
    owner.server.fault = "drop"  # hangs up after the first block
    assert await _pull_fails(puller, owner.source(retained), history) == "protocol"
    assert puller.pulls() == {"protocol": 1}


async def test_blocks_of_another_prompt_are_a_mismatch(
    engine_model: LlamaModel, owner: Owner, start_puller: Callable[[], Node], history: list[int]
) -> None:
    retained = await _retain(owner.node, history)
    other = engine_model.tokenizer.encode(OTHER_TEXT)
    assert len(other) >= 32
    puller = start_puller()
    assert await _pull_fails(puller, owner.source(retained), other) == "mismatch"
    assert puller.pulls() == {"mismatch": 1}


@pytest.mark.parametrize("other", ["model", "numerics"])
async def test_an_owner_of_another_model_or_other_numerics_is_refused_and_counted(
    owner: Owner, start_puller: Callable[[], Node], history: list[int], other: str
) -> None:
    """Another model, or the same one computed with other bits (another BLAS kernel on the
    owner): refused and counted, never a silent difference."""
    retained = await _retain(owner.node, history)
    stranger = (
        serving(owner.node, fingerprint=bytes(32))
        if other == "model"
        else serving(owner.node, numerics=bytes(32))
    )
    outcome = "mismatch" if other == "model" else "numerics"
    async with stranger as served:
        puller = start_puller()
        assert await _pull_fails(puller, served.source(retained), history) == outcome
    assert puller.pulls() == {outcome: 1}
    assert owner.node.sample("understudy_kv_served_blocks_total") == 0


async def test_an_owner_cuts_a_pull_whose_puller_stops_reading(
    engine_model: LlamaModel, owner: Owner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A puller that sends its PULL and stops reading (a stopped or wedged node) holds the
    owner's connection, and the blocks it copied, only until ``SERVE_PULL_TIMEOUT_S``: then
    the owner cuts it, and counts it."""
    monkeypatch.setattr(_transfer, "SERVE_PULL_TIMEOUT_S", SHORT_TIMEOUT_S, raising=False)
    # 57 blocks, about 40 MiB: far more than the socket buffers take while nobody reads
    # (Linux lets a sender's buffer grow to tcp_wmem's maximum, 4 MiB by default).
    retained = await _retain(owner.node, engine_model.tokenizer.encode(OTHER_TEXT * 24))
    engine = owner.node.engine
    pull = PullRequest(
        retained.ticket, 0, retained.num_blocks, engine.model.fingerprint,
        engine.model.numerics.fingerprint, codec=engine.kv_codec_fingerprint,
    )  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (owner.server.host, owner.server.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    kinds: list[FrameKind] = []
    try:
        payload, flags = encode_pull(pull)
        write_frame(writer, FrameKind.PULL, payload, flags)
        await writer.drain()
        # Not reading: the owner's writes stall until SERVE_PULL_TIMEOUT_S cuts the pull.
        await eventually(lambda: owner.node.sample("understudy_kv_serves_cut_total") == 1)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionResetError):
            async with asyncio.timeout(10):
                while True:
                    kinds.append((await read_frame(reader)).kind)
    finally:
        writer.close()
    assert FrameKind.END not in kinds
    assert kinds.count(FrameKind.BLOCK) < retained.num_blocks == 57
    assert owner.node.sample("understudy_kv_serves_cut_total") == 1
    assert owner.node.sample("understudy_kv_served_blocks_total") == 0
    assert await _holds(owner, retained.ticket)  # a cut pull releases nothing


async def test_an_owner_answers_at_most_its_bound_of_pulls_and_refuses_the_rest(
    owner_engine: Engine,
    start_node: Callable[[Engine], Node],
    start_puller: Callable[[], Node],
    history: list[int],
) -> None:
    """A flood of pull connections: ``max_serves`` are answered, every other one gets an ERROR
    frame at once, counted on both sides; the pullers fail cleanly (``busy``) and recompute."""
    async with serving(start_node(owner_engine), max_serves=2) as owner:
        retained = await _retain(owner.node, history)
        address = (owner.server.host, owner.server.port)
        held = [await asyncio.open_connection(*address) for _ in range(2)]  # no PULL yet
        try:
            await eventually(lambda: owner.server.serving == 2)  # both serves are taken
            pullers = [start_puller() for _ in range(5)]
            started = asyncio.get_running_loop().time()
            outcomes = await asyncio.gather(
                *(_pull_fails(p, owner.source(retained), history) for p in pullers)
            )
            took = asyncio.get_running_loop().time() - started
        finally:
            for _, writer in held:
                writer.close()
        assert outcomes == ["busy"] * 5
        assert all(p.pulls() == {"busy": 1} for p in pullers)
        assert took < 2.0  # refused at once, not after a timeout
        assert owner.node.sample("understudy_kv_serves_refused_total") == 5
        # The held connections gone, the owner answers again.
        puller = start_puller()
        await eventually(lambda: owner.server.serving == 0)
        assert await _pull(puller, owner.source(retained), history) == 2
        assert puller.pulls() == {"ok": 1}


async def test_an_owner_reads_no_more_of_a_first_frame_than_a_pull(owner: Owner) -> None:
    """A connection whose first frame announces 32 MiB is closed unread, not buffered."""
    reader, writer = await asyncio.open_connection(owner.server.host, owner.server.port)
    try:
        header = struct.pack("<4sBBHIQ", MAGIC, FrameKind.PULL, 0, 0, 32 << 20, 0)
        writer.write(header + bytes(1024))
        await writer.drain()
        async with asyncio.timeout(2):  # the owner would otherwise wait SERVE_REQUEST_TIMEOUT_S
            assert await reader.read() == b""
    finally:
        writer.close()


async def test_an_owner_with_another_kv_layout_is_a_mismatch(
    owner: Owner, history: list[int]
) -> None:
    retained = await _retain(owner.node, history)
    pool = owner.node.engine.pool
    layout = pool.layout
    wider = KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim * 2, layout.block_size)
    with pytest.raises(KVTransferError) as caught:
        await pull_blocks(
            owner.source(retained),
            0,
            _hashes(owner.node, history),
            fingerprint=pool.seed,
            numerics=owner.node.engine.model.numerics.fingerprint,
            layout=wider,
        )
    assert caught.value.outcome == "mismatch"


async def test_nothing_listening_is_a_connection_failure(
    start_puller: Callable[[], Node], history: list[int]
) -> None:
    source = KVSource("127.0.0.1", free_port(), bytes(16), 2, bytes(32))
    puller = start_puller()
    assert await _pull_fails(puller, source, history) == "connection"
    assert puller.pulls() == {"connection": 1}


async def test_an_owner_that_never_answers_is_a_timeout(
    start_puller: Callable[[], Node], history: list[int]
) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the puller gives up and hangs up
        writer.close()

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = int(listener.sockets[0].getsockname()[1])
    try:
        source = KVSource("127.0.0.1", port, bytes(16), 2, bytes(32))
        puller = start_puller()
        started = asyncio.get_running_loop().time()
        outcome = await _pull_fails(puller, source, history, timeout_s=SHORT_TIMEOUT_S)
        elapsed = asyncio.get_running_loop().time() - started
    finally:
        listener.close()
        await listener.wait_closed()
    assert outcome == "timeout"
    assert SHORT_TIMEOUT_S <= elapsed < DEFAULT_PULL_TIMEOUT_S / 2  # its own bound, not the default
    assert puller.pulls() == {"timeout": 1}


async def test_a_puller_without_room_recomputes(
    engine_model: LlamaModel,
    owner: Owner,
    start_node: Callable[[Engine], Node],
    history: list[int],
) -> None:
    retained = await _retain(owner.node, history)
    one_block = 2 * owner.node.engine.pool.layout.bytes_per_block  # the null block + one
    puller = start_node(Engine(engine_model, one_block))
    assert await _pull_fails(puller, owner.source(retained), history) == "no_room"
    assert puller.pulls() == {"no_room": 1}


# -- kv_transfer_params -----------------------------------------------------------------------


def test_a_source_round_trips_through_kv_transfer_params() -> None:
    source = KVSource("10.0.0.7", 7100, secrets.token_bytes(16), 3, secrets.token_bytes(32))
    params = source.to_params(expires_in_s=12.5)
    assert params["ticket"] == source.ticket.hex() and params["expires_in_s"] == 12.5
    assert KVSource.from_params(params) == source
    assert "expires_in_s" not in source.to_params()


@pytest.mark.parametrize(
    ("change", "value"),
    [
        ("remote_host", 7),
        ("remote_port", 0),
        ("remote_port", 65_536),
        ("remote_port", "7100"),
        ("ticket", "zz"),
        ("ticket", "ab" * 15),
        ("last_block_hash", "ab" * 31),
        ("last_block_hash", None),
        ("num_blocks", 0),
        ("num_blocks", 2.5),
    ],
)
def test_malformed_kv_transfer_params_are_refused(change: str, value: object) -> None:
    params = KVSource("h", 1, bytes(16), 1, bytes(32)).to_params()
    params[change] = value
    with pytest.raises(ValueError, match="kv_transfer_params"):
        KVSource.from_params(params)
    del params[change]
    with pytest.raises(ValueError, match="kv_transfer_params"):
        KVSource.from_params(params)
    with pytest.raises(ValueError, match="kv_transfer_params"):
        KVSource.from_params([params])


def test_booleans_are_not_ports_or_counts() -> None:
    params = KVSource("h", 1, bytes(16), 1, bytes(32)).to_params()
    for field in ("remote_port", "num_blocks"):
        malformed = {**params, field: True}  # JSON true; bool is an int in Python
        try:
            accepted = KVSource.from_params(malformed)
        except ValueError:
            continue
        value = getattr(accepted, field.removeprefix("remote_"))
        pytest.fail(
            f"BUG in backends/engine/_kv_transfer.py KVSource.from_params: {field}=true is "
            f"accepted (as {value!r}, i.e. 1) instead of raising ValueError, because "
            "isinstance(True, int) holds"
        )


# -- the engine's side: retention, import, reclaiming ------------------------------------------


def _synthetic_blocks(engine: Engine, count: int, start: int) -> list[KVBlock]:
    """``count`` chained blocks of made-up tokens and K/V for ``engine``'s layout."""
    layout = engine.pool.layout
    rng = np.random.default_rng(start)
    blocks = []
    parent = engine.pool.seed
    for index in range(count):
        tokens = tuple(
            range(start + index * layout.block_size, start + (index + 1) * layout.block_size)
        )
        block_hash = hash_block(parent, tokens)
        data = rng.standard_normal(layout.block_shape, dtype=np.float32)
        blocks.append(KVBlock(-1, block_hash, parent, tokens, (), data))
        parent = block_hash
    return blocks


def _hold(engine: Engine, blocks: list[KVBlock]) -> RetainedKV:
    """Import ``blocks`` and retain them, as if a request there had computed them."""
    ids = engine.import_kv(blocks)
    retained = engine.retention.retain(ids, [b.block_hash for b in blocks], RETAIN_S)
    assert retained is not None
    return retained


def test_import_reclaims_retained_sets_when_the_pool_is_full(engine_model: LlamaModel) -> None:
    layout = KVLayout.for_model(engine_model.config)
    engine = Engine(engine_model, 5 * layout.bytes_per_block, retained_kv_share=1.0)
    assert engine.pool.num_blocks == 4
    held = _hold(engine, _synthetic_blocks(engine, 2, start=0))
    newer = _hold(engine, _synthetic_blocks(engine, 1, start=1000))
    assert engine.pool.num_free_blocks == 1
    incoming = _synthetic_blocks(engine, 2, start=2000)
    ids = engine.import_kv(incoming)  # needs 2 free: the oldest set goes, the newer stays
    assert engine.pool.lookup([b.block_hash for b in incoming]) == ids
    with pytest.raises(UnknownTicketError):
        engine.export_retained(held.ticket, 0, 1)
    assert len(engine.export_retained(newer.ticket, 0, 1)) == 1
    assert engine.stats().num_retained_blocks == 1
    with pytest.raises(NoFreeBlocksError):  # 5 new blocks never fit 4
        engine.import_kv(_synthetic_blocks(engine, 5, start=3000))


def test_retained_sets_are_reclaimed_before_a_running_request_is_preempted(
    engine_model: LlamaModel, history: list[int]
) -> None:
    layout = KVLayout.for_model(engine_model.config)
    engine = Engine(engine_model, 4 * layout.bytes_per_block, retained_kv_share=1.0)
    assert engine.pool.num_blocks == 3
    held = _hold(engine, _synthetic_blocks(engine, 1, start=0))
    # 31 prompt tokens take 2 blocks; the 33rd token needs a third, which only the retained
    # set holds.
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("r", history[:31], params)
    answer: list[int] = []
    while engine.has_unfinished_requests():
        answer.extend(e.token_id for e in engine.step())
        stats = engine.stats()
        assert stats.num_waiting == 0, "a running request was preempted while KV was retained"
    assert len(answer) == 3
    with pytest.raises(UnknownTicketError):
        engine.export_retained(held.ticket, 0, 1)
    assert engine.release_retained(held.ticket) is False


def test_release_retained_drops_a_set_once(engine_model: LlamaModel) -> None:
    engine = Engine(engine_model, 4 << 20)
    held = _hold(engine, _synthetic_blocks(engine, 2, start=0))
    exported = engine.export_retained(held.ticket, 1, 1)
    assert exported[0].token_ids == tuple(range(16, 32))
    with pytest.raises(IndexError):
        engine.export_retained(held.ticket, 1, 2)
    assert engine.release_retained(held.ticket)
    assert not engine.release_retained(held.ticket)
    assert engine.stats().num_retained_blocks == 0


# -- EngineLoop.call --------------------------------------------------------------------------


@pytest.fixture
def idle_engine(engine_model: LlamaModel) -> Engine:
    return Engine(engine_model, 4 << 20)


async def test_call_runs_on_the_engine_thread(
    idle_engine: Engine, start_node: Callable[[Engine], Node]
) -> None:
    node = start_node(idle_engine)

    def where(engine: Engine) -> tuple[Engine, int]:
        return engine, threading.get_ident()

    engine, thread = await node.loop.call(where)
    assert engine is idle_engine
    assert thread != threading.get_ident()
    order: list[int] = []

    def record(index: int) -> Callable[[Engine], int]:
        def append(engine: Engine) -> int:
            order.append(index)
            return index

        return append

    results = await asyncio.gather(*(node.loop.call(record(i)) for i in range(5)))
    assert results == order == list(range(5))  # one after another, in the order posted


async def test_call_propagates_exceptions_and_the_loop_lives_on(
    idle_engine: Engine, start_node: Callable[[Engine], Node]
) -> None:
    node = start_node(idle_engine)

    def fail(engine: Engine) -> None:
        raise UnknownTicketError("boom")

    with pytest.raises(UnknownTicketError, match="boom"):
        await node.loop.call(fail)
    assert node.loop.alive
    assert await node.loop.call(lambda e: e.pool.num_blocks) == idle_engine.pool.num_blocks


async def test_a_call_pending_at_stop_gets_engine_stopped(
    idle_engine: Engine, start_node: Callable[[Engine], Node]
) -> None:
    node = start_node(idle_engine)
    entered, leave = threading.Event(), threading.Event()

    def block(engine: Engine) -> str:
        entered.set()
        leave.wait(5)
        return "done"

    busy = asyncio.ensure_future(node.loop.call(block))
    assert await asyncio.to_thread(entered.wait, 5)
    pending = asyncio.ensure_future(node.loop.call(lambda e: "never"))
    await asyncio.sleep(0)  # both are posted now
    stopping = asyncio.ensure_future(node.loop.stop(5))
    await asyncio.sleep(0)
    leave.set()
    await stopping
    for call in (busy, pending):
        with pytest.raises(EngineStopped):
            await call
    with pytest.raises(EngineStopped):
        await node.loop.call(lambda e: None)
