"""Quality scorers: how close the candidate's answer is to the primary's.

The primary's answer is the reference; there is no ground truth. A text compares only when
both answers are complete: the observation is ``ok``, not truncated, and its text is known.
Otherwise every pairwise quality value is ``None`` (a failed answer is counted by
``reliability.success``, not disguised as a dissimilar one).

An answer that is only tool calls has the empty text. Two of them would agree as texts
(exact match 1.0) whatever their calls: the text scorers give ``None`` when neither answer
has text and either made a tool call, and ``quality.tool_call_match`` alone judges them.
An answer in text where the other called a tool is compared as text (it differs).

The tool calls of one message are compared as a set (:func:`same_calls`): parallel calls
are independent, their order is not part of the answer.

Rules of cost and of equality (the scoring child must keep up with the traffic):
1. Each text scorer but exact match reads a bounded prefix of each answer, as the sentence
   encoders read their first ``MAX_TEXT_CHARS``: edit similarity the first
   :data:`DEFAULT_MAX_EDIT_CHARS` characters (Levenshtein is quadratic), token F1 the first
   :data:`DEFAULT_MAX_F1_CHARS` (linear, but a Chinese or Japanese character is a token of
   its own). Answers of ordinary length (up to these bounds) score as they always did;
   two longer answers that differ only past the bound score as equal there. Exact match
   compares the whole texts (one ``memcmp``).
2. Tool-call arguments are equal when they are the same JSON value: key order and
   spacing do not count; numbers compare by value, an integer exactly however long (two
   integers past 2**64 are as different as their digits, never rounded to one float), a
   number with a fraction or an exponent as the double it reads as (``1`` equals ``1.0``,
   ``1e2`` equals ``100``); ``true`` and ``false`` are never numbers (``true`` is not
   ``1``, whatever Python's ``True == 1`` says). Arguments that are not JSON, or nested
   deeper than Python can compare (~1,000 levels), are compared as their text.
"""

from __future__ import annotations

import json
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Protocol

import numpy as np
import orjson
from rapidfuzz.distance import Levenshtein

from evaluators._exchange import Exchange
from evaluators._observation import Observation
from evaluators._score import Score

__all__ = [
    "DEFAULT_MAX_EDIT_CHARS",
    "DEFAULT_MAX_F1_CHARS",
    "CaptureScorer",
    "ChoiceCountScorer",
    "EditSimilarityScorer",
    "EmbeddingDistanceScorer",
    "ExactMatchScorer",
    "FinishReasonScorer",
    "JsonValidityScorer",
    "SemanticSimilarityScorer",
    "TextSimilarity",
    "TokenF1Scorer",
    "ToolCallScorer",
    "complete_text",
    "same_calls",
    "token_f1",
]

# Rule 1. Levenshtein is quadratic: at the old cap (65,536 characters a side, None past
# it) one exchange took 0.16 s of CPU in ASCII, 0.9 s in CJK (an alphabet rapidfuzz hashes);
# at this bound 4 ms and 12 ms, and an answer past it gets a value.
DEFAULT_MAX_EDIT_CHARS: Final = 8_192
# Rule 1. Token F1 is linear, but each distinct character of a text beyond ASCII is sorted
# into mark, unspaced script or neither in Python: 80,000 CJK characters a side took 0.4 s,
# 0.04 s at this bound (ASCII: 12 ms and 1 ms).
DEFAULT_MAX_F1_CHARS: Final = 8_192

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = MappingProxyType(str.maketrans("", "", string.punctuation))
_JSON_OPENERS = ("{", "[")
# Rule 2. A negative integer past -2**63 has 19 digits, one past 2**64 - 1 has 20: what
# orjson reads exactly ends there. A run of this many digits anywhere (in a string or a
# fraction too: then it is only read twice) sends the arguments to the standard library.
# Found as zeros in the UTF-8 bytes (a regex took 3x orjson's parse of the arguments).
_LONG_DIGITS: Final = b"0" * 19
_DIGITS_AS_ZERO: Final = bytes.maketrans(b"123456789", b"000000000")
# Runs of Han ideographs (with extension A, compatibility ones and the supplementary
# planes) and kana.
_UNSPACED_RUNS = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
    "\U00020000-\U0003134f]+")


def complete_text(observation: Observation) -> str | None:
    """The answer's text if the whole answer is known, else None."""
    if not observation.ok or observation.truncated:
        return None
    return observation.text


def _texts(exchange: Exchange) -> tuple[str, str] | None:
    primary = complete_text(exchange.primary)
    candidate = complete_text(exchange.candidate_observation)
    if primary is None or candidate is None:
        return None
    if not (primary or candidate) and (exchange.primary.tool_calls
                                       or exchange.candidate_observation.tool_calls):
        return None  # only tool calls on both sides: not a text to compare
    return candidate, primary


def _flag(value: bool) -> float:
    return 1.0 if value else 0.0


def _normalize_answer(text: str) -> list[str]:
    """SQuAD's normalisation: lowercase, drop punctuation and articles, split on spaces;
    beyond ASCII, MLQA's: every Unicode punctuation mark is dropped (a full-width stop,
    guillemets, a dash) and each Chinese or Japanese character is a token of its own,
    since those scripts put no spaces between words (whole sentences would be one token,
    and two near-identical answers score 0)."""
    text = text.lower()
    if text.isascii():
        text = text.translate(_PUNCTUATION)
    else:  # one translate, built per text (each is a dict lookup per character here),
        # then one call a run of unspaced script, not one a character (a regex template
        # per character cost 0.4 s for 80k CJK characters a side)
        marks = dict.fromkeys(ord(c) for c in set(text)
                              if unicodedata.category(c).startswith("P")
                              or c in string.punctuation)
        text = _UNSPACED_RUNS.sub(_spaced_out, text.translate(marks))
    return _ARTICLES.sub(" ", text).split()


def _spaced_out(run: re.Match[str]) -> str:
    return f" {' '.join(run[0])} "


def token_f1(candidate: str, reference: str) -> float:
    """SQuAD token F1 (multiset overlap) of :func:`_normalize_answer`'s tokens; two answers
    with no tokens at all agree (1.0)."""
    cand, ref = _normalize_answer(candidate), _normalize_answer(reference)
    if not cand or not ref:
        return _flag(cand == ref)
    common = sum((Counter(cand) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(cand), common / len(ref)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True, slots=True)
class ExactMatchScorer:
    name: str = "exact_match"

    def score(self, exchange: Exchange) -> list[Score]:
        texts = _texts(exchange)
        value = _flag(texts[0] == texts[1]) if texts is not None else None
        return [Score("quality.exact_match", value, None)]


@dataclass(frozen=True, slots=True)
class EditSimilarityScorer:
    """``1 - Levenshtein distance / max(len)`` of the two texts' first ``max_chars``
    characters (rule 1; 1.0 for two empty ones)."""

    max_chars: int = DEFAULT_MAX_EDIT_CHARS
    name: str = "edit_similarity"

    def score(self, exchange: Exchange) -> list[Score]:
        texts = _texts(exchange)
        if texts is None:
            return [Score("quality.edit_similarity", None, None)]
        candidate, primary = texts[0][:self.max_chars], texts[1][:self.max_chars]
        value = float(Levenshtein.normalized_similarity(candidate, primary))
        return [Score("quality.edit_similarity", value, None)]


@dataclass(frozen=True, slots=True)
class TokenF1Scorer:
    """:func:`token_f1` of the two texts' first ``max_chars`` characters (rule 1)."""

    max_chars: int = DEFAULT_MAX_F1_CHARS
    name: str = "token_f1"

    def score(self, exchange: Exchange) -> list[Score]:
        texts = _texts(exchange)
        value = (token_f1(texts[0][:self.max_chars], texts[1][:self.max_chars])
                 if texts is not None else None)
        return [Score("quality.token_f1", value, None)]


class TextSimilarity(Protocol):
    """How alike two answers are, in [-1, 1], 1.0 for identical texts: the static table
    distilled from all-MiniLM-L6-v2 (``StaticSentenceEncoder``, the default) or the
    encoder itself (``SentenceEncoder``)."""

    def similarity(self, a: str, b: str) -> float: ...

    def similarities(self, pairs: Sequence[tuple[str, str]]) -> list[float]: ...


@dataclass(frozen=True, slots=True)
class SemanticSimilarityScorer:
    """Cosine similarity of the two answers' sentence embeddings.

    Both encoders read the first 256 tokens of each answer (of its first
    ``MAX_TEXT_CHARS`` characters: ``_embedding``). The static one (default)
    costs ~0.1 ms a pair of 200-token answers; MiniLM itself ~15 ms a pair of short
    answers and ~120 ms a pair of 200-token ones here. ``score_batch`` encodes a batch's
    texts together.
    """

    encoder: TextSimilarity
    name: str = "semantic_similarity"

    def score(self, exchange: Exchange) -> list[Score]:
        texts = _texts(exchange)
        value = self.encoder.similarity(texts[0], texts[1]) if texts is not None else None
        return [Score("quality.semantic_similarity", value, None)]

    def score_batch(self, exchanges: Sequence[Exchange]) -> list[list[Score]]:
        """Every pair of the batch through the encoder at once (one tokenizer call, length
        buckets, each distinct text once)."""
        texts = [_texts(exchange) for exchange in exchanges]
        pairs = [t for t in texts if t is not None]
        values = iter(self.encoder.similarities(pairs))
        return [[Score("quality.semantic_similarity",
                       next(values) if t is not None else None, None)] for t in texts]


def _call_key(call: dict[str, Any]) -> tuple[str, Any]:
    """The call's name and its parsed arguments (rule 2). orjson reads an integer past 64
    bits as the nearest float (2**64 and 2**64 + 1 were one value): arguments with a run of
    :data:`_LONG_DIGITS` are read again by the standard library, whose integers are exact.
    """
    arguments = call.get("arguments")
    parsed = arguments  # not text: an object built by hand, compared as it is
    try:
        if isinstance(arguments, str | bytes):
            parsed = orjson.loads(arguments)
            raw = arguments.encode() if isinstance(arguments, str) else arguments
            if _LONG_DIGITS in raw.translate(_DIGITS_AS_ZERO):
                parsed = json.loads(arguments, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # orjson's JSONDecodeError is a ValueError
        # equal only to the very same text: not JSON, an integer of more digits than
        # Python converts (4,300), or nested deeper than the standard library parses
        parsed = ("unparsed", arguments)
    return str(call.get("name")), parsed


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # as orjson refuses it


def _same_json(a: Any, b: Any) -> bool:
    """Rule 2. Python's ``==`` is looser than JSON's equality, never stricter: it says
    ``1 == 1.0`` (wanted) and ``True == 1`` (not). Two values it finds equal are the same
    JSON when they serialise alike (key order aside): the common case, at C speed;
    otherwise (``1`` against ``1.0``, a bool against a number, an integer orjson cannot
    write) :func:`_same_kinds` walks them."""
    if a != b:
        return False
    try:
        if orjson.dumps(a, option=orjson.OPT_SORT_KEYS) == \
                orjson.dumps(b, option=orjson.OPT_SORT_KEYS):
            return True
    except orjson.JSONEncodeError:  # past 64 bits, or nested past orjson's 254 levels
        pass
    return _same_kinds(a, b)


def _same_kinds(a: Any, b: Any) -> bool:
    """Whether two values that Python finds equal hold a bool in the same places."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b)
    pairs: Iterable[tuple[Any, Any]] = ()
    if isinstance(a, dict) and isinstance(b, dict):  # equal: the same keys
        pairs = ((item, b[key]) for key, item in a.items())
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):  # equal: same length
        pairs = zip(a, b, strict=True)
    for x, y in pairs:  # a loop, not all(): one frame a level, as deep as == compares
        if not _same_kinds(x, y):
            return False
    return True


def same_calls(candidate: Sequence[dict[str, Any]], primary: Sequence[dict[str, Any]]) -> bool:
    """Whether two messages' tool calls are the same calls, in any order (a multiset).

    The calls of one message are parallel: the client runs them all and answers each by
    its id, so the order a model lists them in carries no meaning (two backends list the
    same calls in different orders). What is sequential in an agent is the turns, each of
    them an exchange of its own. Each call matches at most one call of the other side, so
    a call made twice matches only a call made twice. Pairs are compared as the keys
    compare (rule 2: ``1`` equals ``1.0`` in arguments, ``true`` does not equal ``1``, big
    integers compare exactly; arguments nested too deep for Python to compare, as their
    text), at most ``MAX_TOOL_CALLS`` a side: a quadratic match is a few thousand
    comparisons at worst."""
    if len(candidate) != len(primary):
        return False
    unmatched = [(_call_key(c), c) for c in primary]
    for call in candidate:
        key = _call_key(call)
        for i, (other, other_call) in enumerate(unmatched):
            if _same_call(key, other, call, other_call):
                del unmatched[i]
                break
        else:
            return False
    return True


def _same_call(key: tuple[str, Any], other: tuple[str, Any], call: dict[str, Any],
               other_call: dict[str, Any]) -> bool:
    try:
        return key[0] == other[0] and _same_json(key[1], other[1])
    except RecursionError:  # orjson parses 1,024 levels, more than a comparison recurses
        return (str(call.get("name")), call.get("arguments")) == \
            (str(other_call.get("name")), other_call.get("arguments"))


@dataclass(frozen=True, slots=True)
class ToolCallScorer:
    """1 when both made the same calls (names and arguments equal as JSON, in any order:
    :func:`same_calls`), else 0.

    ``None`` when neither side called a tool, or when either answer is incomplete.
    """

    name: str = "tool_calls"

    def score(self, exchange: Exchange) -> list[Score]:
        primary, candidate = exchange.primary, exchange.candidate_observation
        complete = all(o.ok and not o.truncated for o in (primary, candidate))
        if not complete or not (primary.tool_calls or candidate.tool_calls):
            return [Score("quality.tool_call_match", None, None)]
        same = same_calls(candidate.tool_calls, primary.tool_calls)
        return [Score("quality.tool_call_match", _flag(same), None)]


def _looks_like_json(text: str) -> bool:
    return text.lstrip().startswith(_JSON_OPENERS)


def _valid_json(text: str) -> bool:
    try:
        return isinstance(orjson.loads(text), dict | list)
    except orjson.JSONDecodeError:
        return False


@dataclass(frozen=True, slots=True)
class JsonValidityScorer:
    """Whether each answer is a valid JSON object or array, for requests that wanted JSON.

    A request that asked for JSON (``response_format``, vLLM's guided or structured JSON:
    ``Exchange.json_requested``) holds both answers to it, the primary's too: a primary
    that answers prose in JSON mode fails it. Otherwise "wanted JSON" is inferred (a
    prompt may ask for it in words): the primary's complete answer begins (after
    whitespace) with ``{`` or ``[``. Validity is strict:
    the whole text must parse as a JSON object or array (no Markdown fences, no prose
    around it). The primary's own value is 0 when it started JSON and did not finish it
    (e.g. cut by ``max_tokens``). Not applicable: both values are ``None``.
    """

    name: str = "json_validity"

    def score(self, exchange: Exchange) -> list[Score]:
        primary = complete_text(exchange.primary)
        candidate = complete_text(exchange.candidate_observation)
        if exchange.json_requested:  # each side on its own, as reliability is
            return [Score("quality.json_valid", _validity(candidate), _validity(primary))]
        if primary is None or not _looks_like_json(primary):
            return [Score("quality.json_valid", None, None)]
        return [Score("quality.json_valid", _validity(candidate), _validity(primary))]


def _validity(text: str | None) -> float | None:
    return _flag(_valid_json(text)) if text is not None else None


@dataclass(frozen=True, slots=True)
class ChoiceCountScorer:
    """Whether each answer has as many choices as the request asked for (``n``, times the
    prompts of a legacy completion): 1 or 0 per backend.

    The text metrics compare choice 0 only, so a candidate that drops the other choices
    (or adds some) would agree on every one of them. ``None`` where the request's count
    is unknown (another route, a body that is not JSON) or the answer's is (a failed or
    truncated answer: ``reliability.success`` and the capture count those).
    """

    name: str = "choices"

    def score(self, exchange: Exchange) -> list[Score]:
        wanted = exchange.requested_choices
        values = [None if wanted is None or not o.ok or o.truncated or o.choices is None
                  else _flag(o.choices == wanted)
                  for o in (exchange.candidate_observation, exchange.primary)]
        return [Score("quality.choices_complete", values[0], values[1])]


@dataclass(frozen=True, slots=True)
class CaptureScorer:
    """Whether each answer outgrew the gateway's capture (``[capture] max_bytes``): 1 or 0
    per backend. Such an answer's text is lost, so every quality value of its exchange is
    ``None``; this says why, and how often, instead of leaving those samples missing
    without a reason (answers cut this way are the longest, so their loss skews the
    quality sample short)."""

    name: str = "capture"

    def score(self, exchange: Exchange) -> list[Score]:
        return [Score("capture.truncated", _flag(exchange.candidate_observation.truncated),
                      _flag(exchange.primary.truncated))]


@dataclass(frozen=True, slots=True)
class FinishReasonScorer:
    name: str = "finish_reason"

    def score(self, exchange: Exchange) -> list[Score]:
        primary = exchange.primary.finish_reason
        candidate = exchange.candidate_observation.finish_reason
        known = exchange.primary.ok and exchange.candidate_observation.ok
        value = (_flag(primary == candidate)
                 if known and primary is not None and candidate is not None else None)
        return [Score("quality.finish_reason_match", value, None)]


@dataclass(frozen=True, slots=True)
class EmbeddingDistanceScorer:
    """How far apart the two backends' embeddings of the same inputs are: the cosine
    distance (1 - cosine) of each input's two vectors, averaged over the inputs (0.0 for
    the same vectors).

    An embeddings answer has no text, so without this its exchange was judged on latency,
    success and cost alone: a candidate returning other vectors passed. ``None`` when
    either answer is not a whole, known embeddings answer (observation rule 10); 1.0 (no
    agreement: unrelated vectors) when the two answers have different numbers of vectors
    or dimensions: a client's index cannot take the candidate's vectors in place of the
    primary's. A zero vector agrees only with a zero vector.
    """

    name: str = "embedding_distance"

    def score(self, exchange: Exchange) -> list[Score]:
        primary, candidate = exchange.primary, exchange.candidate_observation
        value = None
        if (primary.ok and candidate.ok and not primary.truncated and not candidate.truncated
                and primary.embeddings is not None and candidate.embeddings is not None):
            value = _mean_cosine_distance(candidate.embeddings.matrix(),
                                          primary.embeddings.matrix())
        return [Score("quality.embedding_distance", value, None)]


def _mean_cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return 1.0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    dots = np.einsum("ij,ij->i", a64, b64)
    zero_a, zero_b = ~np.any(a64, axis=1), ~np.any(b64, axis=1)
    cosines = np.where(norms > 0.0, dots / np.where(norms > 0.0, norms, 1.0),
                       (zero_a & zero_b).astype(np.float64))
    return float(1.0 - np.clip(cosines, -1.0, 1.0).mean())
