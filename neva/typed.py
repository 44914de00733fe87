"""Strict dataclass construction from plain dicts: unknown keys and wrong types fail with the full key path."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar, Union

# ConfigError lives with the other input errors (neva.errors); every config module imports it from here.
from neva.errors import ConfigError

T = TypeVar("T")


def build(cls: type[T], data: dict[str, Any] | None, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, recursing into nested dataclasses.

    Raises:
        ConfigError: an unknown key (with the closest valid names), a value of the wrong type, or a value the
            dataclass's own validation rejects, always naming the dotted key path.
    """
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key '{path}{key}'{hint}")
    kwargs = {key: _coerce(hints[key], value, f"{path}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as err:
        where = path.rstrip(".") or cls.__name__
        raise ConfigError(f"{where}: {err}") from err


def unknown_key_error(cls: type, dotted: str) -> ConfigError | None:
    """``build``'s refusal of dotted key ``dotted`` (with the closest valid names) when dataclass ``cls`` has no field
    for it; None when it has one, or when the key lies under a mapping typed ``dict`` (which takes any key)."""
    path = ""
    for key in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return None  # a dict-typed field (arch_overrides, ...): any key goes
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(fields))}"
            return ConfigError(f"unknown config key '{path}{key}'{hint}")
        cls, path = typing.get_type_hints(cls)[key], f"{path}{key}."
    return None


def unknown_keys(cls: type, data: dict[str, Any], path: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every key in ``data`` that dataclass ``cls`` (its nested dataclasses included) has
    no field for: what ``build`` would refuse. Mappings typed ``dict`` take any key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    out = []
    for key, value in data.items():
        if key not in fields:
            out.append((f"{path}{key}", value))
            continue
        options = typing.get_args(hints[key]) or (hints[key],)
        nested = next((o for o in options if dataclasses.is_dataclass(o)), None)
        if nested is not None and isinstance(value, dict):
            out += unknown_keys(nested, value, f"{path}{key}.")
    return out


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"'{path}' = {value!r} does not fit {hint}")
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"'{path}' must be a mapping, got {value!r}")
        return build(hint, value, path + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{path}' must be a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{path}' must be a mapping, got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (
        isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    ):
        raise ConfigError(f"'{path}' must be {hint.__name__}, got {value!r}")
    return value
