"""Stage two (LLaVA's visual instruction tuning): projector + LLM (or LoRA) on conversations, from stage one's
output; the replies, about half a conversation's text, are learned."""

from neva.stages.spec import StageSpec

FINETUNE = StageSpec("finetune", starts_from=("pretrain", "pretrained"), text_tokens=450, learned_fraction=0.5)
