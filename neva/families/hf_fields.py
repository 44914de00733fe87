"""How a family's HF decoder config is read, field by field: every field is read, known not to change the
computation, or refused naming the field and its value (``neva.checkpoint.hf_families`` applies the rules).

A rule is ``READ`` (translated into an ``LLMConfig`` field by the family's ``read``), ``INERT`` (does not change what
the forward computes: ids, bookkeeping, generation defaults, initialisation), or ``Needs(values, why)`` (only these
values are implemented; any other is refused). A field in no table is refused too: an unknown field may change the
computation, and guessing would train another model than the one asked for. A family's table is built from
``COMMON``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Read:
    """Translated by ``llm_config_from_hf``."""


@dataclass(frozen=True)
class Needs:
    """Only one of ``values`` is implemented; anything else is refused with ``why``."""

    values: tuple[Any, ...]
    why: str


@dataclass(frozen=True)
class Inert:
    """Known not to change the forward computation."""


READ, INERT = Read(), Inert()

# transformers' PretrainedConfig fields (4.x and 5.x) and common bookkeeping: none changes a decoder's forward.
_CONFIG_BOOKKEEPING = (
    "_name_or_path", "architectures", "transformers_version", "model_type", "dtype", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range",
    "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "return_dict", "output_attentions", "output_hidden_states", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "pruned_heads",
    # generation defaults a 4.x config still carries (generation is configured by neva.generate's own flags)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # Llama's tensor-parallel pretraining split: the same product computed in slices (HF 4.x only, same result).
    "pretraining_tp",
)  # fmt: skip
CONFIG_BOOKKEEPING = _CONFIG_BOOKKEEPING  # also the bookkeeping of top-level multimodal configs (hf_video)

COMMON: dict[str, Any] = {
    **{name: INERT for name in _CONFIG_BOOKKEEPING},
    **{
        name: READ
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
    },
    "hidden_act": Needs(("silu",), "neva's decoder MLP is SwiGLU (silu)"),
    "attention_dropout": Needs((0.0, 0), "neva's decoder has no attention dropout"),
}
