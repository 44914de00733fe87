"""A sentencepiece directory's own ids: transformers 4.x's slow ``LlamaTokenizer``, run on the ``tokenizer.model``.

transformers 5 has no slow Llama tokenizer: it rebuilds every ``tokenizer.model`` as a ``tokenizers`` BPE, which
loses what sentencepiece does and BPE merges cannot: user-defined pieces (matched whole before any merge, so with
LLaVA-1.5's v1 template ``▁USER`` became ``▁U S <0x45> R``), the dummy prefix of each piece of text between special
tokens (``legacy: true``), unknown characters without byte fallback (fused into one ``<unk>``, not dropped). A
directory with a ``tokenizer.model`` and no ``tokenizer.json`` is what LLaVA's trainer and every 4.x user loaded with
this class, so neva loads it with the same rules (``tokenize`` / ``_tokenize`` / special ids as 4.36's
``LlamaTokenizer``), sentencepiece itself doing the splitting. A directory with a ``tokenizer.json`` is a fast
tokenizer and stays one (``load_tokenizer``).

neva's masks need character offsets (``neva.data.encoding``), which slow tokenizers do not give; sentencepiece
records each piece's span of its input, so offsets come with the same pass that makes the ids, shaped as a fast
tokenizer's are (the bytes of one character all span it; a dummy prefix spans the first character).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.tokenization_utils_base import AddedToken, BatchEncoding
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

from neva.hf_local import from_local, model_dir

SPIECE_UNDERLINE = "▁"
SLOW_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast")
Span = tuple[int, int]


class SentencePieceLlamaTokenizer(SentencePieceBackend):
    """transformers 4.x's slow ``LlamaTokenizer`` (``legacy`` as saved; absent = true, 4.x's default), with
    ``return_offsets_mapping``."""

    def __init__(
        self,
        vocab_file: str | None = None,
        unk_token: str = "<unk>",
        bos_token: str = "<s>",
        eos_token: str = "</s>",
        pad_token: str | None = None,
        add_bos_token: bool = True,
        add_eos_token: bool = False,
        legacy: bool | None = None,
        **kwargs: Any,
    ) -> None:
        def special(token: Any) -> Any:
            return AddedToken(token, normalized=False, special=True) if isinstance(token, str) else token

        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        super().__init__(
            vocab_file=vocab_file,
            unk_token=special(unk_token),
            bos_token=special(bos_token),
            eos_token=special(eos_token),
            pad_token=special(pad_token),
            add_bos_token=add_bos_token,
            add_eos_token=add_eos_token,
            legacy=True if legacy is None else legacy,
            **kwargs,
        )

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """transformers' files, with ``tokenizer_config.json`` as 4.x's ``LlamaTokenizer`` saved it: its class name
        (so 4.x loads the directory with the same rules, and neva again with this class), its bos / eos and legacy
        settings, and the extra special tokens under their 4.x name."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        path = Path(save_directory) / "tokenizer_config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        data.update(tokenizer_class="LlamaTokenizer", add_bos_token=self.add_bos_token,
                    add_eos_token=self.add_eos_token, legacy=self.legacy)  # fmt: skip
        extra = data.pop("extra_special_tokens", None) or []
        if isinstance(extra, list):
            known = data.get("additional_special_tokens") or []
            data["additional_special_tokens"] = known + [t for t in extra if t not in known]
        for key in ("backend", "is_local", "local_files_only"):
            data.pop(key, None)
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return out

    # -- ids: 4.36's LlamaTokenizer.tokenize, with each token's span -------------------------------------------

    def tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [token for token, _ in self.tokens_with_offsets(text)]

    def tokens_with_offsets(self, text: str) -> list[tuple[str, Span]]:
        """The tokens 4.x's slow ``LlamaTokenizer`` gives ``text``, each with its ``[start, end)`` in ``text``."""
        if self.legacy or not text:
            return self._split_added(text, 0)
        # legacy false: one "▁" before the whole text (none before each piece between special tokens), dropped
        # again when a special token follows it.
        tokens = self._split_added(SPIECE_UNDERLINE + text.replace(SPIECE_UNDERLINE, " "), -1)
        if len(tokens) > 1 and tokens[0][0] == SPIECE_UNDERLINE and tokens[1][0] in self.all_special_tokens:
            tokens = tokens[1:]
        elif tokens and tokens[0] == (SPIECE_UNDERLINE, (0, 0)):
            tokens[0] = (SPIECE_UNDERLINE, (0, 1))  # the prefix spans the character it stands before
        return tokens

    def _split_added(self, text: str, shift: int) -> list[tuple[str, Span]]:
        """``PreTrainedTokenizer.tokenize``: split on added tokens (their lstrip / rstrip), sentencepiece between."""
        parts, at = [], 0
        for part in self.tokens_trie.split(text):
            parts.append([part, at])
            at += len(part)
        added = self._added_tokens_encoder
        for i, (part, _) in enumerate(parts):
            token = self._added_tokens_decoder.get(added[part]) if part in added else None
            if not isinstance(token, AddedToken):
                continue
            if token.single_word:
                raise NotImplementedError(f"added token {part!r} is single_word, which neva does not split")
            if token.rstrip and i + 1 < len(parts):
                right = parts[i + 1]
                stripped = right[0].lstrip()
                right[1] += len(right[0]) - len(stripped)
                right[0] = stripped
            if token.lstrip and i > 0:
                parts[i - 1][0] = parts[i - 1][0].rstrip()
        out: list[tuple[str, Span]] = []
        specials = set(self.all_special_tokens)
        for part, start in parts:
            if not part:
                continue
            if part in added or part in specials:
                out.append((part, (start, start + len(part))))
            else:
                out.extend((piece, (s + start, e + start)) for piece, (s, e) in self._pieces(part))
        length = len(text) + shift
        return [(tok, (min(max(s + shift, 0), length), min(max(e + shift, 0), length))) for tok, (s, e) in out]

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [piece for piece, _ in self._pieces(text)]

    def _pieces(self, text: str) -> list[tuple[str, Span]]:
        """4.36's ``_tokenize`` (legacy false: no dummy prefix, a leading space kept by encoding ``<unk>`` before it
        and dropping its pieces), each piece with its character span in ``text``."""
        prefix = ""
        if not self.legacy and text.startswith((SPIECE_UNDERLINE, " ")):
            prefix = str(self.unk_token)
        proto = self.sp_model.encode(prefix + text, out_type="proto")
        pieces = list(proto.pieces)
        if prefix:
            drop = len(self.sp_model.encode(prefix))
            pieces = pieces[drop:] if len(pieces) >= drop else pieces
        chars = _byte_to_char(prefix + text)
        spans = [(chars[p.begin] - len(prefix), chars[p.end] - len(prefix)) for p in pieces]
        # A character's byte-fallback pieces: sentencepiece gives the last its span, the others none; a fast
        # tokenizer gives each the character's span.
        for i in range(len(pieces) - 2, -1, -1):
            if spans[i][0] == spans[i][1] and self.sp_model.is_byte(pieces[i].id) and spans[i + 1][0] == spans[i][0]:
                spans[i] = spans[i + 1]
        # The dummy prefix spans the character it stands before, as a fast tokenizer's prepended "▁" does.
        if pieces and spans[0] == (0, 0) and pieces[0].piece == SPIECE_UNDERLINE and text:
            spans[0] = (0, min(1, len(text)))
        return [(p.piece, span) for p, span in zip(pieces, spans)]

    # -- special tokens: 4.x's rule (bos / eos by add_bos_token / add_eos_token) ---------------------------------

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None) -> list:
        bos = [self.bos_token_id] if self.add_bos_token else []
        eos = [self.eos_token_id] if self.add_eos_token else []
        out = bos + token_ids_0 + eos
        return out if token_ids_1 is None else out + bos + token_ids_1 + eos

    def get_special_tokens_mask(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None, already_has_special_tokens: bool = False
    ) -> list[int]:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        bos, eos = [1] * self.add_bos_token, [1] * self.add_eos_token
        out = bos + [0] * len(token_ids_0) + eos
        return out if token_ids_1 is None else out + bos + [0] * len(token_ids_1) + eos

    def _encode_plus(self, text: Any, text_pair: Any = None, **kwargs: Any) -> BatchEncoding:
        if not kwargs.pop("return_offsets_mapping", False):
            return super()._encode_plus(text, text_pair, **kwargs)
        if not isinstance(text, str) or text_pair is not None:
            raise NotImplementedError("offsets of one string at a time only")
        pairs = self.tokens_with_offsets(text)
        ids = self.convert_tokens_to_ids([token for token, _ in pairs])
        offsets = [span for _, span in pairs]
        if kwargs.get("add_special_tokens", True):
            ids = self.build_inputs_with_special_tokens(ids)
            offsets = [(0, 0)] * self.add_bos_token + offsets + [(0, 0)] * self.add_eos_token
        data = {"input_ids": ids, "attention_mask": [1] * len(ids), "offset_mapping": offsets}
        return BatchEncoding(data, tensor_type=kwargs.get("return_tensors"))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """4.36's decoding: sentencepiece between special tokens, the leading dummy-prefix space dropped."""
        tokens = list(tokens)
        if tokens and tokens[0].startswith(SPIECE_UNDERLINE):
            tokens[0] = tokens[0][1:]
        out, run, prev_special = "", [], False
        specials = set(self.all_special_tokens)
        for i, token in enumerate(tokens):
            if token in specials:
                if not prev_special and i != 0 and self.legacy:
                    out += " "
                out += self.sp_model.decode(run) + token
                prev_special, run = True, []
            else:
                run.append(token)
                prev_special = False
        return out + self.sp_model.decode(run)


def _byte_to_char(text: str) -> list[int]:
    """Character index of every UTF-8 byte offset of ``text`` (and of its end)."""
    out = []
    for i, ch in enumerate(text):
        out.extend([i] * len(ch.encode("utf-8")))
    out.append(len(text))
    return out


def is_sentencepiece_llama(directory: str | os.PathLike) -> bool:
    """A slow Llama tokenizer directory: ``tokenizer.model`` and no ``tokenizer.json`` (a fast tokenizer, loaded as
    it is), its ``tokenizer_config.json`` naming a Llama tokenizer class (or none)."""
    path = Path(directory)
    if not (path / "tokenizer.model").is_file() or (path / "tokenizer.json").is_file():
        return False
    config = path / "tokenizer_config.json"
    cls = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") if config.is_file() else None
    return cls is None or cls in SLOW_CLASSES


def load_tokenizer(path: str | os.PathLike, **kwargs: Any) -> Any:
    """The tokenizer of an HF / LLaVA / neva directory with the ids its own files give: a sentencepiece
    ``tokenizer.model`` alone → ``SentencePieceLlamaTokenizer``; otherwise transformers' ``AutoTokenizer``
    (a ``tokenizer.json`` as it is: ``PreTrainedTokenizerFast``). Local files only (``neva.hf_local``)."""
    directory = model_dir(path)
    if is_sentencepiece_llama(directory):
        return from_local(SentencePieceLlamaTokenizer, directory, **kwargs)
    if (Path(directory) / "tokenizer.json").is_file():
        # AutoTokenizer rebuilds a model class's pipeline (LlamaTokenizer: Metaspace, no normalizer) from the file's
        # vocabulary and merges, dropping the file's own normalizer / pre-tokenizer; the generic class keeps it all.
        return from_local(PreTrainedTokenizerFast, directory, **kwargs)
    return from_local(AutoTokenizer, directory, **kwargs)
