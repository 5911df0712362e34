"""One row of figures per measured codec, as ``kv-quality`` prints and ``bench/kvquant.py`` reports.

``bits@L`` is the whole context's bits at ``context`` tokens (sink 32, window 16, the rest the
codec's, ``CodecQuality.effective_bits``); ``longest_context`` the most tokens whose K/V fit
``budget_bytes``, and its ratio to fp16's when fp16 was measured.
"""

from __future__ import annotations

from typing import Any

from ._quality import CodecQuality, QualityReport

__all__ = ["label", "quality_rows"]


def label(result: CodecQuality) -> str:
    """The codec's name, with its window when it is not part of the name."""
    if result.window_tokens == 0 or result.codec.endswith("w"):
        return result.codec
    return f"{result.codec} +w{result.window_tokens}"


def quality_rows(report: QualityReport, context: int, budget_bytes: int) -> list[dict[str, Any]]:
    """Per codec: bits, compression, attention error (mean, worst, per layer), KL, top-1."""
    fp16 = next((r for r in report.results if r.codec == "fp16" and r.window_tokens == 0), None)
    fp16_context = fp16.longest_context(budget_bytes) if fp16 else None
    out = []
    for result in report.results:
        longest = result.longest_context(budget_bytes)
        out.append(
            {
                "codec": label(result),
                "registry_name": result.codec,
                "window_tokens": result.window_tokens,
                "bits_per_element": result.bits_per_element,
                "bits_at_context": result.effective_bits(context),
                "compression_vs_fp16": result.compression_vs_fp16(context),
                "attention_error": result.attention_error,
                "attention_error_worst_layer": max(result.attention_error_per_layer),
                "attention_error_per_layer": list(result.attention_error_per_layer),
                "kl_nats": result.kl_nats,
                "top1": result.top1,
                "positions": result.positions,
                "longest_context": longest,
                "longest_context_vs_fp16": longest / fp16_context if fp16_context else None,
            }
        )
    return out
