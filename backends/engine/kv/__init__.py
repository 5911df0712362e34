"""The KV cache and its transfer: the paged store and its layout, the prefix-cached block pool,
blocks retained for other nodes, the binary wire framing of blocks, pulls between nodes, and
the KV-aware routing policies that decide where a conversation's blocks go.

A KV codec family (quantized keys and values) belongs here, beside the store it encodes.
The engine's public names are exported by ``backends.engine``.
"""
