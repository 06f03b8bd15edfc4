"""Value rules the config dataclasses share: each refuses with the key, the value and a fix."""

from __future__ import annotations

from typing import Any


def at_least(section: str, lo: float, **values: Any) -> None:
    """Refuse any ``section.name`` below ``lo`` (NaN included), naming the value and a fix."""
    for name, v in values.items():
        if not v >= lo:
            raise ValueError(f"{section}.{name}={v} must be >= {lo}; set {section}.{name} to "
                             f"{lo} or more")


def above(section: str, lo: float, **values: Any) -> None:
    """Refuse any ``section.name`` not strictly above ``lo`` (NaN included)."""
    for name, v in values.items():
        if not v > lo:
            raise ValueError(f"{section}.{name}={v} must be > {lo}; set a positive "
                             f"{section}.{name}")


def one_of(key: str, value: Any, choices: tuple) -> None:
    """Refuse ``value`` for ``key`` unless it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}; "
                         f"use {key}={choices[0]}")
