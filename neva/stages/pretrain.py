"""Stage one (LLaVA's pretraining): the projector on image–caption pairs (``plain`` template), LLM and tower frozen;
starts from fresh or HF weights. A caption is short and wholly learned."""

from neva.stages.spec import StageSpec

PRETRAIN = StageSpec("pretrain", text_tokens=100, learned_fraction=1.0)
