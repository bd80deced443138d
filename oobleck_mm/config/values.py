"""Field checks shared by every config section: each takes the dotted path and the raw value and
returns the normalised value, or raises ``ConfigError`` naming the path, the value and what is valid.

Units: durations are ``"500ms"``, ``"3s"``, ``"2m"``, ``"1h"`` or a number of
seconds (-> ``timedelta``); memory sizes are ``"40GiB"``, ``"80GB"`` or bytes
(GB = 1e9, GiB = 2**30); bandwidths are ``"100Gbps"``/``"200Gb/s"`` (bits) or
``"25GB/s"``/``"25GBps"`` (bytes) or a number of bytes/s.
"""

from __future__ import annotations

import reprlib

import difflib
import math
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from oobleck_mm.errors import UserError


class ConfigError(UserError):
    """A mistake in the job configuration; the message starts with the dotted field path."""


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 5, 5, 120, 120


def describe(value: Any) -> str:
    """``value`` as an error message shows it: bounded (a YAML alias bomb would expand to gigabytes)."""
    return f"{_SHORT.repr(value)} ({type(value).__name__})"


def as_int(path: str, value: Any, *, minimum: int | None = None, maximum: int | None = None, why: str = "") -> int:
    # bool is an int subclass in Python; "true" for a batch size is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{path}: must be <= {maximum}{f' ({why})' if why else ''}, got {value}")
    return value


def as_float(
    path: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    below: float | None = None,
) -> float:
    number = value
    # PyYAML follows YAML 1.1, which reads `1e-4` (no dot) as a string.
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise ConfigError(f"{path}: expected a finite number, got {describe(value)}")
    number = float(number)
    if positive and number <= 0:
        raise ConfigError(f"{path}: must be > 0, got {number}")
    if minimum is not None and number < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{path}: must be <= {maximum}, got {number}")
    if below is not None and number >= below:
        raise ConfigError(f"{path}: must be < {below}, got {number}")
    return number


def as_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {describe(value)}")
    return value


def as_bool_or_auto(path: str, value: Any) -> bool | str:
    """true, false, or the string ``auto`` (the engine decides)."""
    if value == "auto" or isinstance(value, bool):
        return value
    raise ConfigError(f"{path}: expected auto, true or false, got {describe(value)}")


def as_str(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: expected a non-empty string, got {describe(value)}")
    return value


def as_choice(path: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{path}: must be one of {valid}, got {describe(value)}")
    return value


_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(rf"^\s*{_NUMBER}\s*(us|ms|s|m|h)?\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*([a-zA-Z]*)\s*$")
_PREFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
# Case matters for bandwidths: "Gb" is gigabits, "GB" gigabytes.
_BANDWIDTH_RE = re.compile(rf"^\s*{_NUMBER}\s*(K|M|G|T|Ki|Mi|Gi|Ti)?(b|B)(ps|/s)\s*$")


def as_duration(path: str, value: Any) -> timedelta:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.match(value)):
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    else:
        raise ConfigError(
            f"{path}: expected a duration like '500ms', '3s', '2m' or a number of seconds, got {describe(value)}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{path}: must be a positive duration, got {describe(value)}")
    if seconds > MAX_DURATION_S:
        raise ConfigError(f"{path}: at most a year ({MAX_DURATION_S:.0f} s), got {describe(value)}")
    return timedelta(seconds=seconds)


MAX_DURATION_S = 365 * 86400.0
"""Longest duration a field may hold: any timeout beyond it is a typo (and overflows timedelta soon after)."""


def as_size(path: str, value: Any) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        num_bytes = float(value)
    elif isinstance(value, str) and (match := _SIZE_RE.match(value)) and match.group(2).lower() in _SIZE_UNITS:
        num_bytes = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    else:
        raise ConfigError(f"{path}: expected a size like '40GiB', '80GB' or a number of bytes, got {describe(value)}")
    if not (math.isfinite(num_bytes) and num_bytes >= 1):
        raise ConfigError(f"{path}: must be a positive size, got {describe(value)}")
    return int(num_bytes)


def as_bandwidth(path: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
    elif isinstance(value, str) and (match := _BANDWIDTH_RE.match(value)):
        bits = match.group(3) == "b"
        rate = float(match.group(1)) * _PREFIX[match.group(2) or ""] / (8 if bits else 1)
    else:
        raise ConfigError(
            f"{path}: expected a bandwidth like '100Gbps', '25GB/s' or a number of bytes/s, got {describe(value)}"
        )
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"{path}: must be a positive bandwidth, got {describe(value)}")
    return rate


def as_str_tuple(path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list of names, got {describe(value)}")
    names = tuple(as_str(f"{path}[{i}]", v) for i, v in enumerate(value))
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: names must be unique, got {list(names)}")
    return names


def check(obj: Any, name: str, convert, *args, **kwargs) -> None:
    """Checks field ``name`` of a section with ``convert`` and stores the normalised value."""
    value = getattr(obj, name)
    setattr(obj, name, convert(f"{type(obj)._PATH}.{name}", value, *args, **kwargs))


def check_optional(obj: Any, name: str, convert, *args, **kwargs) -> None:
    if getattr(obj, name) is not None:
        check(obj, name, convert, *args, **kwargs)


def reject_unknown(raw: Mapping, valid: tuple[str, ...], path: str, where: str = "") -> None:
    for key in raw:
        if key not in valid:
            dotted = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{dotted}'{hint}; valid keys{where}: {', '.join(valid)}")
