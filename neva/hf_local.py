"""Hugging Face configs and tokenizers from local files only: never the Hub, never code shipped with a model.

transformers treats a path that does not exist as a Hub repository name (tens of seconds of retries before an
unrelated error), and asks ``[y/N]`` on stdin before running the code a config's ``auto_map`` names. neva reads
models only from disk — a directory, or a Hub id's snapshot already in the local HF cache (what ``HF_HUB_OFFLINE=1``
allows) — and runs only its own code, so every ``from_pretrained`` and every HF model path goes through here.
"""

from __future__ import annotations

import os
import re
from typing import Any

from neva.errors import InputError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class LocalModelError(InputError, ValueError):
    """A model path that is not a local directory, or one whose loading needs the model's own Python code."""


def model_dir(path: str | os.PathLike) -> str:
    """The local directory of ``path``: the directory itself, or for a Hub id (``lmsys/vicuna-7b-v1.5``) that is not
    a directory here, its snapshot (``refs/main``) in the local HF cache (``HF_HUB_CACHE`` / ``HF_HOME``). Nothing is
    ever downloaded.

    Raises:
        LocalModelError: neither a directory nor a cached Hub id; the message names it and how to fetch it.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if _HUB_ID.fullmatch(path):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return snapshot_download(path, local_files_only=True)
        except LocalEntryNotFoundError:
            raise LocalModelError(
                f"{path!r} is not a local directory, and the local Hugging Face cache holds no snapshot of the Hub id "
                f"{path!r}. neva never downloads: fetch it first (`hf download {path}`, then pass {path} again, or "
                "`hf download NAME --local-dir DIR` and pass DIR)."
            ) from None
    raise LocalModelError(
        f"{path!r} is not a local directory. neva loads Hugging Face models from local directories (or Hub ids already "
        "in the local HF cache) only and never looks a name up on the Hub: download it first (e.g. "
        "`hf download NAME --local-dir DIR`) and pass DIR."
    )


def from_local(loader: Any, path: str | os.PathLike, **kwargs: Any) -> Any:
    """``loader.from_pretrained(model_dir(path))`` (``AutoConfig``, ``AutoTokenizer``, ...) with
    ``local_files_only=True`` and ``trust_remote_code=False``.

    Raises:
        LocalModelError: ``path`` is not a directory or a cached Hub id, transformers cannot load its files, or
            loading it needs remote code; the message names the path.
    """
    path = model_dir(path)
    try:
        return loader.from_pretrained(path, local_files_only=True, trust_remote_code=False, **kwargs)
    except (OSError, ValueError) as err:
        if "custom code" in str(err) or "trust_remote_code" in str(err):
            raise LocalModelError(
                f"{path}: loading it needs Python code shipped with the model (`auto_map` in its config); neva does "
                "not run such code. Use a model whose architecture transformers provides."
            ) from err
        # transformers' refusal of the directory's files (none of a tokenizer's, a config.json that is not JSON or
        # has no model_type): about the user's directory, so its path is named.
        raise LocalModelError(f"{path}: {loader.__name__} cannot load it: {err}") from err
