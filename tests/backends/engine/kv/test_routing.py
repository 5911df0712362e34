"""Routing disaggregated requests: the conversation index, the cluster's prices, the policies.

Pure: hashes of synthetic prompts, a fake clock; no model, no sockets.
"""

from __future__ import annotations

import pytest

from backends.engine.kv._blockpool import BlockHash, hash_blocks
from backends.engine.kv._routing import (
    DECODE_SLOT_S,
    MAX_ESTIMATED_BLOCKS,
    NODE_DOWN_S,
    POLICIES,
    Cluster,
    ConversationIndex,
    KVRecord,
    RouteJob,
)
from backends.engine.kv._transfer import KVSource
from backends.engine.serving._server_config import ROUTING_POLICIES, RoutingPolicyName
from tests.backends.engine.kv.fake_clock import FakeClock

SEED = bytes(32)
BLOCK_SIZE = 4
TTL_S = 60.0


def _hashes(num_blocks: int, start: int = 0) -> list[BlockHash]:
    tokens = list(range(start, start + num_blocks * BLOCK_SIZE))
    return hash_blocks(SEED, tokens, BLOCK_SIZE)


def _record(
    hashes: list[BlockHash],
    num_blocks: int,
    *,
    prefill_node: int = 0,
    decode_node: int = 0,
    expires_at: float = 1e9,
    filed_under: BlockHash | None = None,
) -> KVRecord:
    last = hashes[num_blocks - 1] if filed_under is None else filed_under
    source = KVSource("127.0.0.1", 9000 + decode_node, bytes(16), num_blocks, last)
    return KVRecord(source, prefill_node, decode_node, expires_at)


def _job(
    hashes: list[BlockHash], record: KVRecord | None = None, *, readback: bool = True
) -> RouteJob:
    return RouteJob(len(hashes) * BLOCK_SIZE + 2, tuple(hashes), record, readback)


# -- the conversation index -------------------------------------------------------------------


def test_match_finds_the_longest_live_record() -> None:
    index = ConversationIndex(clock=FakeClock())
    prompt = _hashes(6)
    turn1, turn2 = _record(prompt, 2), _record(prompt, 4)
    index.add(turn1)
    index.add(turn2)
    index.add(_record(_hashes(6, start=1000), 5))  # another conversation
    assert index.match(prompt) is turn2
    assert index.match(prompt[:3]) is turn1  # the next turn's prompt diverged at block 3
    assert index.match(prompt[:1]) is None
    assert index.match([]) is None
    assert index.match(_hashes(6, start=2000)) is None


def test_match_ignores_a_record_filed_at_another_position() -> None:
    index = ConversationIndex(clock=FakeClock())
    prompt = _hashes(4)
    # Filed under block 2's hash but claiming 3 blocks: its hash and extent disagree.
    index.add(_record(prompt, 3, filed_under=prompt[1]))
    assert index.match(prompt) is None
    honest = _record(prompt, 1)
    index.add(honest)
    assert index.match(prompt) is honest


def test_match_drops_expired_records_and_falls_back_to_a_shorter_one() -> None:
    clock = FakeClock()
    index = ConversationIndex(clock=clock)
    prompt = _hashes(5)
    short = _record(prompt, 2, expires_at=clock.now + 2 * TTL_S)
    long = _record(prompt, 4, expires_at=clock.now + TTL_S)
    index.add(short)
    index.add(long)
    assert index.match(prompt) is long
    clock.now += TTL_S  # expired at its deadline exactly
    assert index.match(prompt) is short
    assert len(index) == 1
    clock.now += TTL_S
    assert index.match(prompt) is None
    assert len(index) == 0


def test_the_index_keeps_the_most_recently_used_records() -> None:
    index = ConversationIndex(capacity=2, clock=FakeClock())
    a, b, c = _hashes(2, 0), _hashes(2, 100), _hashes(2, 200)
    index.add(_record(a, 2))
    index.add(_record(b, 2))
    assert index.match(a) is not None  # a is used: b is now the least recently used
    index.add(_record(c, 2))
    assert len(index) == 2
    assert index.match(b) is None
    assert index.match(a) is not None and index.match(c) is not None


def test_a_new_record_replaces_the_one_under_the_same_hash() -> None:
    index = ConversationIndex(clock=FakeClock())
    prompt = _hashes(3)
    index.add(_record(prompt, 3, decode_node=0))
    newer = _record(prompt, 3, decode_node=1)
    index.add(newer)
    assert len(index) == 1 and index.match(prompt) is newer


# -- the cluster ------------------------------------------------------------------------------


def test_readable_blocks_need_a_record_and_read_back() -> None:
    prompt = _hashes(4)
    record = _record(prompt, 3)
    assert _job(prompt, record).readable_blocks == 3
    assert _job(prompt, record, readback=False).readable_blocks == 0
    assert _job(prompt).readable_blocks == 0


def test_a_prefill_node_computes_what_it_neither_holds_nor_reads_back() -> None:
    cluster = Cluster(2, 1, BLOCK_SIZE)
    prompt = _hashes(5)
    job = _job(prompt)  # 22 tokens
    assert cluster.to_compute(0, job) == 22
    cluster.prefill_started(1, 22)
    cluster.prefill_finished(1, 22, prompt[:2])
    assert cluster.to_compute(1, job) == 22 - 2 * BLOCK_SIZE
    assert cluster.to_compute(0, _job(prompt, _record(prompt, 4))) == 22 - 4 * BLOCK_SIZE
    assert cluster.to_compute(0, _job(prompt, _record(prompt, 4), readback=False)) == 22
    assert cluster.prefill[1].queued_tokens == 0


def test_the_cache_estimate_forgets_the_oldest_blocks() -> None:
    cluster = Cluster(1, 1, BLOCK_SIZE)
    first = [bytes([1]) * 32]
    rest = [i.to_bytes(32, "big") for i in range(MAX_ESTIMATED_BLOCKS)]
    cluster.prefill_finished(0, 0, first)
    cluster.prefill_finished(0, 0, rest[:-1])
    assert cluster.to_compute(0, _job(first)) == 2  # still estimated as held
    cluster.prefill_finished(0, 0, rest[-1:])
    assert cluster.to_compute(0, _job(first)) == BLOCK_SIZE + 2


def test_learning_moves_the_prices_toward_the_samples() -> None:
    cluster = Cluster(1, 1, BLOCK_SIZE)
    token_price, block_price = cluster.prefill_s_per_token, cluster.transfer_s_per_block
    token_sample, block_sample = 10 * token_price, block_price / 10
    cluster.learn(100, 100 * token_sample, 10, 10 * block_sample)
    assert token_price < cluster.prefill_s_per_token < token_sample
    assert block_sample < cluster.transfer_s_per_block < block_price
    for _ in range(100):
        cluster.learn(100, 100 * token_sample, 10, 10 * block_sample)
    assert cluster.prefill_s_per_token == pytest.approx(token_sample, rel=1e-3)
    assert cluster.transfer_s_per_block == pytest.approx(block_sample, rel=1e-3)


def test_empty_reports_teach_nothing() -> None:
    cluster = Cluster(1, 1, BLOCK_SIZE)
    prices = (cluster.prefill_s_per_token, cluster.transfer_s_per_block)
    cluster.learn(0, 1.0, 0, 1.0)
    cluster.learn(100, 0.0, 10, 0.0)
    assert (cluster.prefill_s_per_token, cluster.transfer_s_per_block) == prices


# -- policies ---------------------------------------------------------------------------------


def test_every_configurable_policy_exists() -> None:
    assert set(POLICIES) == set(ROUTING_POLICIES)


def test_round_robin_rotates_both_kinds_of_node() -> None:
    cluster = Cluster(2, 3, BLOCK_SIZE)
    policy = POLICIES["round-robin"]()
    prompt = _hashes(2)
    job = _job(prompt, _record(prompt, 2, prefill_node=1, decode_node=2))  # ignored
    choices = [policy.choose(job, cluster) for _ in range(5)]
    assert choices == [(0, 0), (1, 1), (0, 2), (1, 0), (0, 1)]


def test_affinity_keeps_a_conversation_on_its_nodes() -> None:
    cluster = Cluster(2, 2, BLOCK_SIZE)
    policy = POLICIES["affinity"]()
    prompt = _hashes(3)
    continuing = _job(prompt, _record(prompt, 2, prefill_node=1, decode_node=0))
    cluster.prefill_started(1, 10_000)  # however loaded its node is
    cluster.decode_streams[0] = 50
    assert policy.choose(_job(_hashes(3, 100)), cluster) == (0, 0)
    assert policy.choose(continuing, cluster) == (1, 0)
    assert policy.choose(_job(_hashes(3, 200)), cluster) == (1, 1)  # new ones keep rotating
    assert policy.choose(continuing, cluster) == (1, 0)
    assert policy.choose(_job(_hashes(3, 300)), cluster) == (0, 0)


def test_kv_aware_reads_history_back_rather_than_wait_in_a_queue() -> None:
    cluster = Cluster(2, 2, BLOCK_SIZE)
    policy = POLICIES["kv-aware"]()
    prompt = _hashes(6)
    # Node 0 prefilled the last turn (its cache holds it) but has a queue now: a few tokens of
    # waiting cost more than reading 4 blocks back.
    cluster.prefill_finished(0, 0, prompt[:4])
    cluster.prefill_started(0, 10)
    job = _job(prompt, _record(prompt, 4, prefill_node=0, decode_node=1))
    assert cluster.prefill_cost(1, job) < cluster.prefill_cost(0, job)
    assert policy.choose(job, cluster)[0] == 1
    # Without read-back, node 1 would compute the whole history: node 0 wins.
    assert policy.choose(_job(prompt, job.record, readback=False), cluster)[0] == 0


def test_kv_aware_picks_the_shorter_queue_when_both_can_read_back() -> None:
    cluster = Cluster(3, 1, BLOCK_SIZE)
    policy = POLICIES["kv-aware"]()
    prompt = _hashes(6)
    job = _job(prompt, _record(prompt, 4, decode_node=0))
    cluster.prefill_started(0, 300)
    cluster.prefill_started(1, 40)
    cluster.prefill_started(2, 200)
    assert policy.choose(job, cluster)[0] == 1
    cluster.prefill_finished(1, 40, ())
    cluster.prefill_started(1, 500)
    assert policy.choose(job, cluster)[0] == 2


def test_kv_aware_prefers_a_prefill_node_that_holds_the_prefix_on_equal_queues() -> None:
    cluster = Cluster(3, 1, BLOCK_SIZE)
    policy = POLICIES["kv-aware"]()
    system_prompt = _hashes(5)
    cluster.prefill_finished(2, 0, system_prompt[:3])  # another conversation, same system prompt
    assert policy.choose(_job(system_prompt), cluster)[0] == 2
    # A conversation whose history node 1 cached saves the read-back transfer there.
    cluster.prefill_finished(1, 0, system_prompt)
    job = _job(system_prompt, _record(system_prompt, 5, decode_node=0))
    assert policy.choose(job, cluster)[0] == 1
    # On a full tie the lowest index wins.
    assert policy.choose(_job(_hashes(5, 100)), cluster)[0] == 0


def test_kv_aware_decodes_where_the_conversation_is_unless_that_node_is_busy() -> None:
    cluster = Cluster(1, 3, BLOCK_SIZE)
    policy = POLICIES["kv-aware"]()
    prompt = _hashes(10)
    job = _job(prompt, _record(prompt, 8, decode_node=2))
    assert policy.choose(job, cluster)[1] == 2
    assert policy.choose(_job(prompt), cluster)[1] == 0  # nobody holds a new conversation
    # Node 2 saves 8 block transfers; enough streams there outweigh them.
    saved_s = 8 * cluster.transfer_s_per_block
    streams = int(saved_s / DECODE_SLOT_S) + 1
    cluster.decode_streams[2] = streams
    assert policy.choose(job, cluster)[1] == 0
    cluster.decode_streams[0] = streams
    cluster.decode_streams[1] = streams
    assert policy.choose(job, cluster)[1] == 2  # equally busy everywhere: locality again


# -- nodes that failed (rule 4) ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_leaves_a_down_node_out_until_it_may_be_up_again(
    name: RoutingPolicyName,
) -> None:
    """A dead decode node has no streams and holds the conversation: without rule 4 kv-aware
    and affinity send the conversation's every turn (and kv-aware every new one) to it."""
    clock = FakeClock()
    cluster = Cluster(2, 2, BLOCK_SIZE, clock=clock)
    policy = POLICIES[name]()
    prompt = _hashes(6)
    continuing = _job(prompt, _record(prompt, 5, prefill_node=0, decode_node=0))
    jobs = [continuing, _job(_hashes(6, 100)), continuing, _job(_hashes(6, 200))]
    cluster.node_down("decode", 0)
    cluster.node_down("prefill", 1)
    assert [policy.choose(job, cluster) for job in jobs] == [(0, 1)] * 4
    clock.now += NODE_DOWN_S
    assert cluster.available("decode") == cluster.available("prefill") == [0, 1]
    chosen = {policy.choose(job, cluster) for job in jobs}
    assert (0, 0) in chosen  # tried again
    # Every node of a kind down: the choice is among all of them, as before.
    cluster.node_down("decode", 0)
    cluster.node_down("decode", 1)
    assert cluster.available("decode") == [0, 1]
    assert policy.choose(_job(_hashes(6, 300)), cluster)[1] in (0, 1)
