"""The llava-hf interop (CLIP / SigLIP towers with any supported decoder, and text-only decoders): transformers'
LLaVA wrappers (``hf_wrappers``), imported by ``hf_import`` and written by ``hf_export``."""

from __future__ import annotations

import warnings
from typing import Any

from neva.checkpoint.hf_config import llava_config_dict, neva_config_from_llava
from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.hf_import import llava_parts
from neva.checkpoint.hf_wrappers import WRAPPERS, wrapper_for
from neva.checkpoint.interop import Interop
from neva.models.config import NevaConfig
from neva.typed import ConfigError


def _round_trip(arch: NevaConfig) -> str:
    config = llava_config_dict(arch)
    try:
        wrapper = wrapper_for(arch)
    except ValueError as err:  # no transformers class takes the features together; the export refuses the same way
        raise ConfigError(str(err)) from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        neva_config_from_llava({**config, "model_type": wrapper.model_type})
    return wrapper.model_type


def _recognises(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in {row.model_type for row in WRAPPERS}


LLAVA_HF = Interop("llava-hf", _recognises, llava_parts, export_llava, _round_trip)
