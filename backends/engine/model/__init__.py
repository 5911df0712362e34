"""The model: SmolLM2 read from its GGUF, its tokenizer and chat template, the forward pass
(attention, linear layers, the lane-mapped products that keep every BLAS kernel bitwise exact,
the numerics fingerprint) and sampling.

Nothing here knows about serving; the KV layout it writes into comes from ``engine.kv``.
The engine's public names are exported by ``backends.engine``.
"""
