"""Serving roles: the engine's scheduler and its thread, requests and their events, the
OpenAI front (vLLM's wire protocol from ``backends.openai_wire``), the unified, prefill and
decode servers, the KV side of the disaggregated nodes, the router, metrics and the CLI.

The engine's public names are exported by ``backends.engine``.
"""
