"""hybridkv as a vLLM 0.33 KV connector.

Turn it on with::

    --kv-transfer-config '{"kv_connector": "HybridKVConnector",
                           "kv_connector_module_path": "hybridkv.connectors.vllm",
                           "kv_role": "kv_producer"}'

The class is resolved lazily so that importing ``connectors`` never imports
vLLM (only vLLM's factory asks for ``HybridKVConnector``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HybridKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "HybridKVConnector":
        from hybridkv.connectors.vllm.connector import HybridKVConnector

        return HybridKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
