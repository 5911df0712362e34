"""All traffic seen and dropped, as bounded histograms (gateway/_traffic.py)."""

from __future__ import annotations

from gateway._traffic import BYTES_PER_TOKEN_ESTIMATE, TrafficTally, size_bucket, turn_depth


def test_size_buckets_are_powers_of_two_of_estimated_tokens() -> None:
    assert size_bucket(0) == 0
    assert size_bucket(BYTES_PER_TOKEN_ESTIMATE * 100) == 64
    assert size_bucket(BYTES_PER_TOKEN_ESTIMATE * 128) == 128


def test_turn_depth_counts_assistant_messages() -> None:
    assert turn_depth(None) is None and turn_depth({"prompt": "x"}) is None
    messages = [{"role": "user"}, {"role": "assistant"}, {"role": "user"},
                {"role": "assistant"}, {"role": "user"}]
    assert turn_depth({"messages": messages}) == 2


def test_tally_counts_seen_and_drops_but_not_unsampled() -> None:
    tally = TrafficTally()
    tally.seen("chat_completions", True, 0, 400)
    tally.dropped("c", "buffer_full", 4000)
    tally.dropped("c", "not_sampled", 4000)  # uniform by design: no bias to count
    counts = {(c.candidate, c.outcome, c.dimension, c.value): c.count for c in tally.drain()}
    assert counts == {("", "seen", "size", "64"): 1, ("", "seen", "route", "chat_completions"): 1,
                      ("", "seen", "streamed", "yes"): 1, ("", "seen", "turn_depth", "<1"): 1,
                      ("c", "buffer_full", "size", "512"): 1}
    assert len(tally) == 0


def test_tally_is_bounded_and_counts_what_it_lost() -> None:
    tally = TrafficTally(max_keys=4)
    tally.seen("chat_completions", False, None, 10)  # four keys
    tally.dropped("c", "buffer_full", 10)
    assert len(tally) == 4 and tally.overflowed == 1
    counts = tally.drain()
    tally.restore(counts)  # a failed flush gives them back
    assert len(tally) == 4
