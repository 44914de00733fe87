"""What counts as a user's bad input, and how every entry point reports it: one line on stderr, exit status 2.

A bad input — a config key, a file, a value — ends the command with one line naming it (``config error: …`` for the
configuration, ``error: …`` for the rest) and exit status 2, argparse's status for bad arguments; nothing already
written is touched. Any other exception is a bug and keeps its traceback. ``--debug`` on any entry point's command line
(or ``NEVA_DEBUG=1``) shows the traceback of an input error too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

DEBUG_FLAG = "--debug"
DEBUG_ENV = "NEVA_DEBUG"
EXIT_BAD_INPUT = 2

F = TypeVar("F", bound=Callable[..., Any])


class InputError(Exception):
    """A user's input neva refuses; the message names the key, file or value (subclasses: ``ConfigError``, the
    data, checkpoint and local-model errors)."""


class ConfigError(InputError, ValueError):
    """A configuration problem, reported before any work starts."""


def _hydra_refusals() -> tuple[type[BaseException], ...]:
    # Hydra's own refusals of a command line (a misspelled key, a bad override, a missing config group) name what was
    # given; its other exceptions (instantiation) wrap code errors.
    from hydra.errors import ConfigCompositionException, OverrideParseException, SearchPathException

    return (ConfigCompositionException, OverrideParseException, SearchPathException)


# A path the user gave that is missing or unreadable: the OS error names it.
_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def is_input_error(err: BaseException) -> bool:
    """True for a user's bad input (reported as one line), False for a bug (which keeps its traceback)."""
    if isinstance(err, (InputError, *_hydra_refusals())):
        return True
    return isinstance(err, _PATH_ERRORS) and err.filename is not None


def one_line(text: str) -> str:
    """``text``'s lines joined into one: ``; `` between items, a space where a sentence or a list head continues."""
    out = ""
    for line in filter(None, (part.strip() for part in text.splitlines())):
        out += ("" if not out else " " if out.endswith((":", ".", ",", ";")) else "; ") + line
    return out


def error_line(err: BaseException) -> str:
    """The one line an input error prints as."""
    if isinstance(err, _PATH_ERRORS) and err.filename is not None:
        text = f"{err.filename}: {err.strerror}"
    else:
        text = str(err)
    label = "config error" if isinstance(err, (ConfigError, *_hydra_refusals())) else "error"
    return f"{label}: {one_line(text)}"


def debugging() -> bool:
    """Whether input errors keep their traceback (``--debug`` / ``NEVA_DEBUG=1``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


@contextlib.contextmanager
def exit_on_input_error(debug: bool = False) -> Iterator[None]:
    """The body of an entry point: an input error ends the command with its one line on stderr and exit status 2
    (raised as it is when ``debug``)."""
    try:
        yield
    except Exception as err:
        if debug or debugging() or not is_input_error(err):
            raise
        print(error_line(err), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_INPUT) from None


def entry_point(main: F) -> F:
    """Decorate an entry point's ``main(argv=None)`` (argparse or Hydra alike): ``--debug`` is taken off the command
    line before the entry point's own parser sees it, and the body runs under ``exit_on_input_error`` unless
    debugging."""

    @functools.wraps(main)
    def run(argv: Sequence[str] | None = None) -> Any:
        args = sys.argv[1:] if argv is None else list(argv)
        debug = DEBUG_FLAG in args
        if debug:
            args = [a for a in args if a != DEBUG_FLAG]
            if argv is None:  # the process's own command line: processes it starts (Lightning's launcher) inherit it
                sys.argv[1:] = args
                os.environ[DEBUG_ENV] = "1"
        with exit_on_input_error(debug):
            return main(None if argv is None else args)

    return run  # type: ignore[return-value]
