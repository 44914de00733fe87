"""Hugging Face configs and tokenizers from local directories only: never the Hub, never code shipped with a model.

transformers treats a path that does not exist as a Hub repository name (tens of seconds of retries before an
unrelated error), and asks ``[y/N]`` on stdin before running the code a config's ``auto_map`` names. neva reads
models only from directories on disk and runs only its own code, so every ``from_pretrained`` goes through here.
"""

from __future__ import annotations

import os
from typing import Any


class LocalModelError(ValueError):
    """A model path that is not a local directory, or one whose loading needs the model's own Python code."""


def from_local(loader: Any, path: str | os.PathLike, **kwargs: Any) -> Any:
    """``loader.from_pretrained(path)`` (``AutoConfig``, ``AutoTokenizer``, ...) with ``local_files_only=True`` and
    ``trust_remote_code=False``.

    Raises:
        LocalModelError: ``path`` is not a directory, or loading it needs remote code; the message names the path.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise LocalModelError(
            f"{path!r} is not a local directory. neva loads Hugging Face models from local directories only and never "
            "looks a name up on the Hub: download it first (e.g. `hf download NAME --local-dir DIR`) and pass DIR."
        )
    try:
        return loader.from_pretrained(path, local_files_only=True, trust_remote_code=False, **kwargs)
    except ValueError as err:
        if "custom code" not in str(err) and "trust_remote_code" not in str(err):
            raise
        raise LocalModelError(
            f"{path}: loading it needs Python code shipped with the model (`auto_map` in its config); neva does not "
            "run such code. Use a model whose architecture transformers provides."
        ) from err
