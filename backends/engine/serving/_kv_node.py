"""The KV side of the disaggregated roles: what prefill and decode nodes add to an engine app.

Rules
-----
1. Prefill and decode nodes run a ``KVTransferServer`` next to their HTTP listener (started and
   closed in a ``cleanup_ctx``); what a finished request retains can be pulled from it.
2. A prefill node answers ``POST /kv/v1/prefill``: it computes the prompt's full blocks (as a
   one-token request whose token is dropped: the decode node samples every token itself, so
   seeded sampling is the same as on a unified engine) and retains them for
   ``DEFAULT_PREFILL_RETAIN_S``; its answer is their ``kv_transfer_params``.  A partial last
   block is left to the decode node.
3. When the request names a previous turn's KV (``kv_source``, kept by a decode node), the
   prefill node first reads those blocks back -- the ones its own cache lacks -- if that saves
   at least ``kv_readback_min_tokens`` of computation.  A failed read-back is counted and the
   prompt computed in full: slower, never wrong.
4. A decode node given ``kv_transfer_params`` pulls the prompt's blocks it lacks from the
   prefill node (which then releases them), then runs the request as a unified engine would,
   retaining prompt + answer for the next turn; the final chunk carries that set's
   ``kv_transfer_params``.  A failed pull means the decode node computes the prompt itself.
5. Either node pulls only from its KV peers (``kv._peers``): ``kv_transfer_params`` or a
   ``kv_source`` naming another host is a 400 before any connection is opened, counted as a
   pull of outcome ``untrusted``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from backends.openai_wire import (
    RequestError,
    decode_body,
    invalid_value,
    is_token_ids,
    json_response,
)

from ..kv._blockpool import BlockHash, hash_blocks
from ..kv._peers import KVPeers
from ..kv._retention import RetainedKV
from ..kv._transfer import (
    DEFAULT_MAX_KV_SERVES,
    KVSource,
    KVTransferError,
    KVTransferServer,
    pull_missing_blocks,
)
from ..model._sampling import SamplingParams
from ._engine_loop import EngineLoop, EngineServerError
from ._metrics import EngineMetrics
from ._request import TokenEvent

__all__ = [
    "KV_SERVER",
    "PREFILL_ROUTE",
    "KVNode",
    "install_kv_node",
    "prefill",
    "receive_prompt_kv",
]

log = logging.getLogger(__name__)

PREFILL_ROUTE = "/kv/v1/prefill"
_DROPPED_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


class KVNode:
    """What a prefill or decode node's handlers need for KV exchange."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        metrics: EngineMetrics,
        *,
        retain_s: float,
        readback_min_tokens: int,
        listen_host: str,
        listen_port: int,
        peers: KVPeers,
        max_serves: int = DEFAULT_MAX_KV_SERVES,
    ) -> None:
        self.engine_loop = engine_loop
        self.peers = peers
        self.listen_host = listen_host
        self.listen_port = listen_port  # 0: any free port; ``server.port`` once started
        self.metrics = metrics
        self.retain_s = retain_s
        self.readback_min_tokens = readback_min_tokens
        pool = engine_loop.engine.pool
        self.seed: bytes = pool.seed
        self.block_size = pool.block_size
        model_fingerprint = engine_loop.engine.model.fingerprint
        self.server = KVTransferServer(
            engine_loop, metrics, fingerprint=model_fingerprint, max_serves=max_serves
        )

    def hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        return hash_blocks(self.seed, token_ids, self.block_size)

    def transfer_params(self, retained: RetainedKV) -> dict[str, Any]:
        """``kv_transfer_params`` naming a retained set on this node."""
        source = KVSource.retained_at(self.server.host, self.server.port, retained)
        # The router hashes the next turn's prompt with this seed (router rule 5).
        return {**source.to_params(self.retain_s), "hash_seed": self.seed.hex()}

    async def check_peer(self, source: KVSource, param: str) -> None:
        """``RequestError`` (400) if ``source`` is not on one of this node's peers (rule 5)."""
        if await self.peers.admits(source.host):
            return
        self.metrics.pulled("untrusted")
        log.warning("refused a KV pull from %s:%d: not a KV peer", source.host, source.port)
        raise invalid_value(
            f"{param} names a KV host this node does not pull from; its KV peers are "
            f"{self.peers.describe()} (--kv-peer)",
            param=f"{param}.remote_host",
            value=source.host,
        )

    async def pull(
        self, source: KVSource, hashes: Sequence[BlockHash], *, min_tokens: int, release: bool
    ) -> int:
        """Pull ``source``'s blocks of this prompt that the cache lacks; how many came (0 on a
        failure, counted, or when fewer than ``min_tokens`` tokens' worth were missing)."""
        try:
            return await pull_missing_blocks(
                self.engine_loop,
                self.metrics,
                source,
                hashes,
                min_blocks=-(-min_tokens // self.block_size),
                release_after=release,
            )
        except KVTransferError as exc:
            log.warning("KV pull from %s:%d failed (%s): %s; recomputing", source.host,
                        source.port, exc.outcome, exc)  # fmt: skip
            return 0


KV_SERVER = web.AppKey("kv_node", KVNode)


async def _kv_server_ctx(app: web.Application) -> AsyncIterator[None]:
    node = app[KV_SERVER]
    await node.server.start(node.listen_host, node.listen_port)
    try:
        yield
    finally:
        await node.server.close()


def install_kv_node(app: web.Application, node: KVNode) -> None:
    """Run ``node``'s KV server with ``app`` (rule 1)."""
    app[KV_SERVER] = node
    app.cleanup_ctx.append(_kv_server_ctx)


# -- prefill ---------------------------------------------------------------------------------


async def prefill(request: web.Request) -> web.StreamResponse:
    """``POST /kv/v1/prefill`` ``{"prompt_token_ids": [...], "kv_source": {...} | null}``.

    Answers the retained set's ``kv_transfer_params`` (null when the prompt has no full block)
    and what it cost: tokens computed and seconds computing, blocks read back and seconds
    reading them (the router learns its prices from these).
    """
    started = time.perf_counter()
    node = request.app[KV_SERVER]
    try:
        prompt, source = _prefill_body(decode_body(await request.read()), node)
        if source is not None:
            await node.check_peer(source, "kv_source")
    except RequestError as exc:
        return json_response(exc.body(), exc.status)
    full = len(prompt) // node.block_size * node.block_size
    pulled = 0
    if source is not None:
        hashes = node.hashes(prompt[:full])
        pulled = await node.pull(source, hashes, min_tokens=node.readback_min_tokens, release=False)
    pulled_at = time.perf_counter()
    last: TokenEvent | None = None
    if full:
        try:
            last = await _compute(node, prompt[:full])
        except EngineServerError as exc:
            return json_response(exc.body(), exc.status)
    retained = None if last is None else last.retained
    return json_response(
        {
            "kv_transfer_params": None if retained is None else node.transfer_params(retained),
            "prompt_tokens": len(prompt),
            "computed_tokens": 0 if last is None else full - last.cached_tokens,
            "compute_s": time.perf_counter() - pulled_at,
            "pulled_blocks": pulled,
            "pull_s": pulled_at - started,
        }
    )


async def _compute(node: KVNode, prompt: list[int]) -> TokenEvent:
    """Run the prompt as a one-token request that retains its blocks; its last event."""
    loop = node.engine_loop
    handle = loop.submit(
        prompt,
        _DROPPED_TOKEN,
        arrived_at=asyncio.get_running_loop().time(),
        retain_kv_s=node.retain_s,
    )
    try:
        while True:
            item = await handle.queue.get()
            if isinstance(item, EngineServerError):
                raise item
            if item[-1].finished:
                return item[-1]
    finally:
        loop.release(handle)


def _prefill_body(body: object, node: KVNode) -> tuple[list[int], KVSource | None]:
    if not isinstance(body, dict):
        raise RequestError("The body must be a JSON object.", param="body")
    prompt = body.get("prompt_token_ids")
    vocab = node.engine_loop.engine.model.config.vocab_size
    if not is_token_ids(prompt) or not all(0 <= t < vocab for t in prompt):  # bools are not ids
        raise RequestError(
            f"prompt_token_ids must be a non-empty list of token ids in [0, {vocab}).",
            param="prompt_token_ids",
        )
    raw_source = body.get("kv_source")
    try:
        source = None if raw_source is None else KVSource.from_params(raw_source)
    except ValueError as exc:
        raise RequestError(str(exc), param="kv_source") from None
    return prompt, source


# -- decode ----------------------------------------------------------------------------------


async def receive_prompt_kv(node: KVNode, body: dict[str, Any], prompt: Sequence[int]) -> int:
    """Pull the prompt's blocks named by the body's ``kv_transfer_params`` (rule 4); how many
    came.  ``RequestError`` if the parameters are malformed or name no peer (rule 5)."""
    raw = body.get("kv_transfer_params")
    if raw is None:
        return 0
    try:
        source = KVSource.from_params(raw)
    except ValueError as exc:
        raise RequestError(str(exc), param="kv_transfer_params") from None
    await node.check_peer(source, "kv_transfer_params")
    return await node.pull(source, node.hashes(prompt), min_tokens=0, release=True)
