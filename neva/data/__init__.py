"""Data pipeline: LLaVA records → templates and exact masks → CLIP pixels → padded or packed batches.

Names are imported lazily so that ``import neva.data.sampler`` (or a DataLoader worker) loads only what it uses.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Collator": "neva.data.collate",
    "collate_packed": "neva.data.collate",
    "collate_padded": "neva.data.collate",
    "DataConfig": "neva.data.config",
    "get_template": "neva.data.templates.registry",
    "parse_conversations": "neva.data.conversation",
    "NevaDataModule": "neva.data.datamodule",
    "ConversationDataset": "neva.data.dataset",
    "EncoderSettings": "neva.data.dataset",
    "ImageProcessor": "neva.data.images",
    "SampleError": "neva.data.errors",
    "ResumableBatchSampler": "neva.data.sampler",
    "DataQualityError": "neva.data.skips",
    "SkipTracker": "neva.data.skips",
    "build_tokenizer": "neva.data.synthetic",
    "synthetic_eval_records": "neva.data.synthetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'neva.data' has no attribute {name!r}")
