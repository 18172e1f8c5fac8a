"""tierkv as a vLLM V1 KV connector (docs/vllm.md).

vLLM loads ``TierKVConnector`` from this package (``kv_connector_module_path``:
``tierkv.integrations.vllm``). Importing the package does not import vLLM; the connector
class is loaded when asked for, so that its parts (pages, config, scheduler and worker
sides) stay importable on their own.
"""
from __future__ import annotations

from typing import Any

__all__ = ["TierKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierKVConnector":
        from .connector import TierKVConnector
        return TierKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
