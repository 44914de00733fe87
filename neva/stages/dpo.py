"""The preference stage (DPO and its variants: ``model.dpo``): pairs of a chosen and a rejected reply to one prompt,
from stage two's output, against a reference (a frozen copy of the starting weights, the adapters switched off under
LoRA, or log-probs computed once before training). A pair is two decoder sequences; the planner takes a finetune's
conversation for each."""

from neva.stages.spec import StageSpec

DPO = StageSpec(
    "dpo",
    starts_from=("finetune", "finetuned"),
    text_tokens=450,
    learned_fraction=0.5,
    sequences_per_sample=2,
    reference=lambda cfg: not cfg.model.dpo.precompute_ref_log_probs,
    data_module="neva.training.dpo:preference_data_module",
    objective="neva.training.dpo:preference_objective",
    rehearsal_batches="neva.training.dpo:rehearsal_pairs",
    # Under PP its reference's own pipeline pass would need its schedule set up in the rehearsal too.
    rehearses_pipeline=False,
)
