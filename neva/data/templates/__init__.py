"""Conversation templates: LLaVA-format turns → prompt text plus the character spans that are learned.

The generic formats (``generic``: plain, vicuna_v1, llama_2, mistral, llama_3, chatml) and the tokenizer's own chat
template (``chat_template``) are shared; a model family's own format lives in its own module here (``qwen_vl``,
``internvl``, ``glm4v``, ``mistral3``, ``gemma3``: the template class with its image token, image block and exported
Jinja body), named by the family's spec (``TowerSpec.template`` / ``DecoderSpec.template``). ``registry`` lists them
all by name (docs/ARCHITECTURE.md, "Adding a family").
"""
