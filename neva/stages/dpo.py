"""The preference stage (DPO and its variants: ``model.dpo``): pairs of a chosen and a rejected reply to one prompt,
from stage two's output, against a reference (a frozen copy of the starting weights, the adapters switched off under
LoRA, or log-probs computed once before training). A pair is two decoder sequences; the planner takes a finetune's
conversation for each."""

from typing import Any

from neva.stages.spec import StageSpec
from neva.typed import ConfigError

# The settings the stage cannot run with, each with why (key, refused value, reason).
PREFERENCE_REFUSED = (
    ("model.loss_normalization", lambda c: c.model.loss_normalization != "global_tokens",
     "the preference stage averages over the global batch's pairs (global_tokens)"),
    ("model.data.packing", lambda c: c.model.data.packing, "every reply keeps a row of its own"),
)  # fmt: skip


def check_preference_config(cfg: Any) -> None:
    """Raises: ConfigError naming the first key the preference stage (``stage=dpo``) cannot run with."""
    for key, refused, why in PREFERENCE_REFUSED:
        if refused(cfg):
            raise ConfigError(f"stage=dpo: {key} is not supported here: {why}")
    policy = cfg.model.trainable_policy()
    if policy.lora is not None and (policy.vision or policy.projector):
        raise ConfigError(
            "stage=dpo with model.peft.peft_scheme=lora takes the model with its adapters off as the reference: set "
            "model.mm_cfg.freeze_projector=true (and keep the tower frozen) so that it stays the starting weights"
        )


DPO = StageSpec(
    "dpo",
    starts_from=("finetune", "finetuned"),
    text_tokens=450,
    learned_fraction=0.5,
    sequences_per_sample=2,
    reference=lambda cfg: not cfg.model.dpo.precompute_ref_log_probs,
    check=check_preference_config,
    data_module="neva.training.dpo:preference_data_module",
    objective="neva.training.dpo:preference_objective",
    rehearsal_batches="neva.training.dpo:rehearsal_pairs",
    # Under PP its reference's own pipeline pass would need its schedule set up in the rehearsal too.
    rehearses_pipeline=False,
)
