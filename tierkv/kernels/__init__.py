"""Triton kernels of tierkv: attention that reads K/V in place from the paged device pool.

Public API (see docs/kernels.md):

* :func:`paged_decode_attention` - one decode token per request over its own pages.
* :func:`plan_cascade` / :func:`cascade_attention` - shared prefixes read once per step.
* :func:`merge_states` - combine two attention parts in fp32.
* :func:`should_use_cascade` / :func:`attention_decode` - the rule for when cascade pays.
* ``reference`` - the PyTorch definitions the kernels are tested against.
"""
from __future__ import annotations

import os

# The kernel sources live in the repository's top-level kernels/ directory, which has no
# __init__.py: a package there would shadow the Hugging Face `kernels` package (that
# transformers and vLLM import) whenever Python runs from the repository root. In a source
# tree or an editable install this package reaches them through its ``__path__``; a built
# wheel has them copied in here (setup.py's build_py).
_SOURCES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")
if os.path.isfile(os.path.join(_SOURCES, "paged_decode.py")) and _SOURCES not in __path__:
    __path__.append(_SOURCES)

# The imports below resolve through the __path__ above.
from .base import AttentionOutput, KernelInputError, TileConfig, default_tiles  # noqa: E402
from .cascade import CascadePlan, LevelPlan, SharedLevel, cascade_attention, plan_cascade
from .merge import merge_states
from .paged_decode import paged_decode_attention
from .policy import (
    CostModel,
    DecodeEstimate,
    attention_decode,
    estimate_decode,
    min_prefix_len,
    plan_pays,
    should_use_cascade,
)

__all__ = [
    "AttentionOutput", "CascadePlan", "CostModel", "DecodeEstimate", "KernelInputError", "LevelPlan",
    "SharedLevel", "TileConfig", "attention_decode", "cascade_attention", "default_tiles",
    "estimate_decode", "merge_states", "min_prefix_len", "paged_decode_attention", "plan_cascade",
    "plan_pays", "should_use_cascade",
]
