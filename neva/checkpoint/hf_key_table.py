"""Key names between neva and transformers 5 for the multimodal classes laid out as ``vision_tower.`` /
``multi_modal_projector.`` / ``language_model.`` (InternVL, Mistral 3): one definition of the mapping, each family
giving its tables."""

from __future__ import annotations

from dataclasses import dataclass

from neva.checkpoint.hf_keys import LM_HEAD, part_key_from_hf, part_key_to_hf


def _strip(key: str, prefixes: tuple[str, ...]) -> str | None:
    return next((key[len(p) :] for p in prefixes if key.startswith(p)), None)


@dataclass(frozen=True)
class KeyTable:
    """``layers``: the tower's block list under the vision prefix (``encoder.layer.``); ``block``: neva's name within
    a block → HF's; ``tower``: whole names outside the blocks; ``projector``: neva's prefix → HF's. The decoder's keys
    are the llava-hf ones (``neva.checkpoint.hf_keys``). Prefixes: the ``save_pretrained`` layout's first (what export
    writes), then the module names'."""

    layers: str
    block: dict[str, str]
    tower: dict[str, str]
    projector: dict[str, str]
    vision_prefixes: tuple[str, ...] = ("vision_tower.", "model.vision_tower.")
    projector_prefixes: tuple[str, ...] = ("multi_modal_projector.", "model.multi_modal_projector.")
    llm_prefixes: tuple[str, ...] = ("language_model.model.", "model.language_model.")
    lm_head_keys: tuple[str, ...] = ("language_model.lm_head.weight", "lm_head.weight")

    def to_neva(self, key: str) -> str | None:
        """neva key of an HF tensor (None: a key neva does not keep)."""
        if key in self.lm_head_keys:
            return "llm." + LM_HEAD
        if (rest := _strip(key, self.vision_prefixes)) is not None:
            for neva, hf in self.tower.items():
                if rest == hf:
                    return "vision." + neva
            if rest.startswith(self.layers):
                index, _, tail = rest[len(self.layers) :].partition(".")
                for neva, hf in self.block.items():
                    if tail.startswith(hf):
                        return f"vision.layers.{index}.{neva}{tail[len(hf) :]}"
            return None
        if (rest := _strip(key, self.projector_prefixes)) is not None:
            for neva, hf in self.projector.items():
                if rest.startswith(hf):
                    return f"projector.{neva}{rest[len(hf) :]}"
            return None
        if (rest := _strip(key, self.llm_prefixes)) is not None:
            neva = part_key_from_hf(rest, "llm")
            return None if neva is None else "llm." + neva
        return None

    def to_hf(self, key: str) -> str:
        """HF key (transformers 5's ``save_pretrained`` layout) of a neva key."""
        part, rest = key.split(".", 1)
        if part == "vision":
            if rest in self.tower:
                return self.vision_prefixes[0] + self.tower[rest]
            _, index, tail = rest.split(".", 2)
            hf = next(h + tail[len(n) :] for n, h in self.block.items() if tail.startswith(n))
            return f"{self.vision_prefixes[0]}{self.layers}{index}.{hf}"
        if part == "projector":
            prefix = self.projector_prefixes[0]
            return prefix + next(h + rest[len(n) :] for n, h in self.projector.items() if rest.startswith(n))
        if rest == LM_HEAD:
            return self.lm_head_keys[0]
        return self.llm_prefixes[0] + part_key_to_hf(rest, "llm")
