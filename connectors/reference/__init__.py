"""A small reference engine: a Qwen3.5-shaped hybrid model served through hybridkv.

It integrates hybridkv the way an engine connector does (planned layout, the
fencing `TransferScheduler`, the NIXL producer/consumer endpoints), so the demo
and the end-to-end tests exercise the same API the vLLM and SGLang connectors use.
"""
