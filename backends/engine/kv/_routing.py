"""Where a conversation's KV lives, and which prefill and decode nodes a request goes to.

Rules
-----
1. A conversation is known by its KV.  After each turn the decode node reports the blocks it
   retains (count and last block hash); the router files that record under the last hash.  A
   request whose prompt hashes to that value at that block continues the conversation: hashes
   chain over every earlier token, so an equal hash is an equal prefix.  Records expire with
   the decode node's retention and are bounded (``MAX_CONVERSATIONS``, least recently used
   first out).
2. Every policy sees the same ``RouteJob`` and the same ``Cluster`` (the load the router itself
   tracks: prefill tokens in flight per prefill node, streams in flight per decode node, and an
   estimate of each prefill node's cache: the block hashes of prompts sent there).
   * ``round-robin`` rotates both kinds of node.
   * ``affinity`` keeps a continuing conversation on the nodes of its previous turn (the
     classic sticky session); a new conversation goes round robin.
   * ``kv-aware`` prices every node and takes the cheapest (on a tie the less busy, then the
     lower index):
     a prefill node costs the wait for the prefill tokens queued there, plus the tokens it would
     compute for this prompt (all but what it holds or can read back from the decode node that
     retains the conversation), plus the read-back transfer; a decode node costs the transfer
     of the prompt blocks it lacks plus ``DECODE_SLOT_S`` per stream it already runs.  With
     bidirectional KV any prefill node can read a history back, so locality is worth a transfer,
     not a queue.
3. The prices are learned, not configured: seconds per computed prefill token and per
   transferred block are moving averages of what the prefill nodes report.
4. A node that failed at the transport (refused the connection, hung up, or went silent: the
   router calls ``node_down``) is left out of every policy's choice for ``NODE_DOWN_S``, as long
   as another node of its kind is up; then it is tried again.  A continuing conversation whose
   node is down goes to an up one (``affinity`` for that kind of node only).  Without this a
   dead decode node, free of streams and holding the conversation, is the cheapest and the
   stickiest: every request would go on failing there until the records expire.  With every
   node of a kind down, all of them are chosen from as before.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..serving._server_config import RoutingPolicyName
from ._blockpool import BlockHash
from ._transfer import KVSource

__all__ = [
    "DECODE_SLOT_S",
    "MAX_CONVERSATIONS",
    "NODE_DOWN_S",
    "POLICIES",
    "Cluster",
    "ConversationIndex",
    "KVRecord",
    "NodeRole",
    "RouteJob",
    "RoutingPolicy",
]

MAX_CONVERSATIONS = 10_000
# Blocks of prompt history remembered per prefill node (about its cache at 1 GiB of KV).
MAX_ESTIMATED_BLOCKS = 4096
# What one more running stream costs a decode node's others, per request (a coarse price).
DECODE_SLOT_S = 0.05
# Starting prices, replaced by what the prefill nodes report (rule 3).
INITIAL_PREFILL_S_PER_TOKEN = 0.003
INITIAL_TRANSFER_S_PER_BLOCK = 0.002
_EWMA = 0.2
# Rule 4: how long a node that failed at the transport is left out of the choice.
NODE_DOWN_S = 10.0

NodeRole = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class KVRecord:
    """The KV a decode node retains for a conversation, and the nodes of its last turn."""

    source: KVSource
    prefill_node: int
    decode_node: int
    expires_at: float


class ConversationIndex:
    """Records of retained conversation KV, found by prompt hashes (rule 1)."""

    def __init__(
        self, capacity: int = MAX_CONVERSATIONS, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self._clock = clock
        self._records: OrderedDict[BlockHash, KVRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: KVRecord) -> None:
        key = record.source.last_block_hash
        self._records[key] = record
        self._records.move_to_end(key)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def match(self, hashes: Sequence[BlockHash]) -> KVRecord | None:
        """The live record covering the longest prefix of a prompt's block hashes."""
        now = self._clock()
        for index in range(len(hashes) - 1, -1, -1):
            record = self._records.get(hashes[index])
            if record is None or record.source.num_blocks != index + 1:
                continue
            if record.expires_at <= now:
                del self._records[hashes[index]]
                continue
            self._records.move_to_end(hashes[index])
            return record
        return None


@dataclass(frozen=True, slots=True)
class RouteJob:
    """What the policies know of one request."""

    prompt_tokens: int
    hashes: tuple[BlockHash, ...]  # of the prompt's full blocks
    record: KVRecord | None  # the conversation's retained KV, if any
    readback: bool  # whether the prefill node may read that KV back

    @property
    def readable_blocks(self) -> int:
        return self.record.source.num_blocks if self.record is not None and self.readback else 0


@dataclass(slots=True)
class _PrefillNode:
    queued_tokens: int = 0
    cached: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)

    def held_blocks(self, hashes: Sequence[BlockHash]) -> int:
        count = 0
        for block_hash in hashes:
            if block_hash not in self.cached:
                break
            count += 1
        return count


class Cluster:
    """The router's view of its nodes: load in flight, cache estimates, learned prices."""

    def __init__(
        self,
        num_prefill: int,
        num_decode: int,
        block_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.prefill = [_PrefillNode() for _ in range(num_prefill)]
        self.decode_streams = [0] * num_decode
        self.prefill_s_per_token = INITIAL_PREFILL_S_PER_TOKEN
        self.transfer_s_per_block = INITIAL_TRANSFER_S_PER_BLOCK
        self._clock = clock
        # Rule 4: until when each node is left out of the choice.
        self._down_until: dict[NodeRole, list[float]] = {
            "prefill": [-math.inf] * num_prefill,
            "decode": [-math.inf] * num_decode,
        }

    # -- availability (rule 4) --------------------------------------------------------------

    def node_down(self, role: NodeRole, node: int) -> None:
        """``node`` failed at the transport: leave it out for ``NODE_DOWN_S``."""
        self._down_until[role][node] = self._clock() + NODE_DOWN_S

    def available(self, role: NodeRole) -> list[int]:
        """The nodes of ``role`` to choose from: those not down, or all if every one is."""
        now = self._clock()
        up = [n for n, until in enumerate(self._down_until[role]) if until <= now]
        return up or list(range(len(self._down_until[role])))

    # -- prices -----------------------------------------------------------------------------

    def to_compute(self, node: int, job: RouteJob) -> int:
        """Prompt tokens prefill node ``node`` would compute for ``job``."""
        held = max(self.prefill[node].held_blocks(job.hashes), job.readable_blocks)
        return max(0, job.prompt_tokens - held * self.block_size)

    def prefill_cost(self, node: int, job: RouteJob) -> float:
        state = self.prefill[node]
        readback = max(0, job.readable_blocks - state.held_blocks(job.hashes))
        tokens = state.queued_tokens + self.to_compute(node, job)
        return tokens * self.prefill_s_per_token + readback * self.transfer_s_per_block

    def decode_cost(self, node: int, job: RouteJob) -> float:
        record = job.record
        held = record.source.num_blocks if record is not None and record.decode_node == node else 0
        missing = max(0, len(job.hashes) - held)
        return missing * self.transfer_s_per_block + self.decode_streams[node] * DECODE_SLOT_S

    # -- bookkeeping ------------------------------------------------------------------------

    def prefill_started(self, node: int, tokens: int) -> None:
        self.prefill[node].queued_tokens += tokens

    def prefill_finished(self, node: int, tokens: int, hashes: Sequence[BlockHash]) -> None:
        state = self.prefill[node]
        state.queued_tokens -= tokens
        for block_hash in hashes:
            state.cached[block_hash] = None
            state.cached.move_to_end(block_hash)
        while len(state.cached) > MAX_ESTIMATED_BLOCKS:
            state.cached.popitem(last=False)

    def learn(self, computed_tokens: int, compute_s: float, blocks: int, transfer_s: float) -> None:
        """Fold a prefill node's report into the prices."""
        if computed_tokens > 0 and compute_s > 0:
            sample = compute_s / computed_tokens
            self.prefill_s_per_token += _EWMA * (sample - self.prefill_s_per_token)
        if blocks > 0 and transfer_s > 0:
            sample = transfer_s / blocks
            self.transfer_s_per_block += _EWMA * (sample - self.transfer_s_per_block)


# -- policies --------------------------------------------------------------------------------


class RoutingPolicy(Protocol):
    def choose(self, job: RouteJob, cluster: Cluster) -> tuple[int, int]:
        """``(prefill node, decode node)`` for ``job``."""


class RoundRobin:
    def __init__(self) -> None:
        self._turns = itertools.count()

    def choose(self, job: RouteJob, cluster: Cluster) -> tuple[int, int]:
        turn = next(self._turns)
        prefill, decode = cluster.available("prefill"), cluster.available("decode")
        return prefill[turn % len(prefill)], decode[turn % len(decode)]


class Affinity:
    def __init__(self) -> None:
        self._new = RoundRobin()

    def choose(self, job: RouteJob, cluster: Cluster) -> tuple[int, int]:
        record = job.record
        if record is None:
            return self._new.choose(job, cluster)
        prefill, decode = record.prefill_node, record.decode_node
        prefill_up = prefill in cluster.available("prefill")
        decode_up = decode in cluster.available("decode")
        if prefill_up and decode_up:
            return prefill, decode
        new_prefill, new_decode = self._new.choose(job, cluster)  # rule 4: off a down node
        return prefill if prefill_up else new_prefill, decode if decode_up else new_decode


class KVAware:
    def choose(self, job: RouteJob, cluster: Cluster) -> tuple[int, int]:
        # Equal prices go to the less busy node, then to the lower index.
        prefill = min(
            cluster.available("prefill"),
            key=lambda n: (cluster.prefill_cost(n, job), cluster.prefill[n].queued_tokens, n),
        )
        decode = min(
            cluster.available("decode"),
            key=lambda n: (cluster.decode_cost(n, job), cluster.decode_streams[n], n),
        )
        return prefill, decode


POLICIES: dict[RoutingPolicyName, Callable[[], RoutingPolicy]] = {
    "kv-aware": KVAware,
    "affinity": Affinity,
    "round-robin": RoundRobin,
}
