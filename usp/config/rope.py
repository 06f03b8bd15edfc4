"""``model.rope_scaling``: RoPE frequency scaling for context extension, in transformers' form.

The dict uses transformers' names (its ``config.rope_parameters``, less ``rope_theta``, which is
``model.rope_theta``): ``rope_type`` and the keys of that type. The formulas are in
``usp/models/rope.py``. ``dynamic`` and ``longrope`` are refused: they pick their frequencies
from the largest position in the batch, which under sequence parallelism differs per rank,
and in training from the batch's length, not the model's.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Optional

# rope_type -> (required keys, optional keys)
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")),
}
REFUSED = {
    "dynamic": "it rescales by the length of the batch in hand (the largest position id), "
               "which under sequence parallelism differs per rank and in training follows the "
               "batch, not the model",
    "longrope": "it switches its factors on the length of the batch in hand (the largest "
                "position id), which under sequence parallelism differs per rank",
}


# each type as the dictionary model.rope_scaling takes (Llama 3.1's llama3; YaRN x4 of 32K)
EXAMPLES = {
    "linear": "{rope_type:linear,factor:4}",
    "llama3": "{rope_type:llama3,factor:8,low_freq_factor:1,high_freq_factor:4,"
              "original_max_position_embeddings:8192}",
    "yarn": "{rope_type:yarn,factor:4,original_max_position_embeddings:32768}",
}


def _number(key: str, value: Any, low: float, strict: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value > low if strict else value >= low)
    if not ok:
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(f"model.rope_scaling.{key}={value!r} must be a number {bound}")
    return float(value)


def check_rope_scaling(scaling: Optional[dict]) -> Optional[dict]:
    """The scaling with its numbers as floats, None for plain RoPE (None, ``{}`` or
    ``rope_type: default``); refuses an unknown or refused type, a missing or unknown key and
    a value out of range, each with the fix."""
    if not scaling:
        return None
    if isinstance(scaling, str):
        _refuse_a_name(scaling)
    if not isinstance(scaling, Mapping):
        raise ValueError(f"model.rope_scaling={scaling!r} is not a dictionary; give one in "
                         f"transformers' names, e.g. model.rope_scaling={EXAMPLES['yarn']}")
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None)
    if kind is None:
        raise ValueError(f"model.rope_scaling={scaling} names no rope_type; add rope_type: one "
                         f"of {', '.join(ROPE_TYPES)}")
    if kind in REFUSED:
        raise ValueError(f"model.rope_scaling.rope_type={kind} cannot train: {REFUSED[kind]}; "
                         "use yarn (or linear, llama3) with a fixed factor")
    if kind not in ROPE_TYPES:
        raise ValueError(f"model.rope_scaling.rope_type={kind!r} is not one of "
                         f"{', '.join(ROPE_TYPES)}")
    if "rope_theta" in scaling:
        raise ValueError("model.rope_scaling has rope_theta; the base is model.rope_theta: move "
                         "it there")
    required, optional = ROPE_TYPES[kind]
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"model.rope_scaling with rope_type {kind} needs {', '.join(missing)}; "
                         f"e.g. model.rope_scaling={{rope_type:{kind},"
                         + ",".join(f"{k}:..." for k in required) + "}")
    for key in scaling:
        if key not in required + optional:
            near = difflib.get_close_matches(key, required + optional, n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ValueError(f"model.rope_scaling.{key} is not a key of rope_type {kind} (its "
                             f"keys: {', '.join(required + optional) or 'none'}){hint}")
    if kind == "default":
        return None
    out: dict[str, Any] = {"rope_type": kind}
    for key, value in scaling.items():
        if key == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"model.rope_scaling.truncate={value!r} must be true or false")
            out[key] = value
        elif key == "factor":
            out[key] = _number(key, value, 1.0)
        elif key in ("original_max_position_embeddings",):
            out[key] = int(_number(key, value, 1.0))
        else:
            out[key] = _number(key, value, 0.0, strict=key != "mscale_all_dim")
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(f"model.rope_scaling.high_freq_factor={out['high_freq_factor']:g} must "
                         f"be above low_freq_factor={out['low_freq_factor']:g} (Llama 3.1: 4 "
                         "and 1)")
    return out


def _refuse_a_name(name: str) -> None:
    """``model.rope_scaling=yarn``: a type's name alone has none of its numbers."""
    if name in EXAMPLES:
        raise ValueError(f"model.rope_scaling={name} names the type but not its "
                         f"{', '.join(ROPE_TYPES[name][0])}, which have no default; give the "
                         f"dictionary, e.g. model.rope_scaling={EXAMPLES[name]}")
    if name in REFUSED:
        raise ValueError(f"model.rope_scaling.rope_type={name} cannot train: {REFUSED[name]}; "
                         f"use yarn, e.g. model.rope_scaling={EXAMPLES['yarn']}")
    raise ValueError(f"model.rope_scaling={name!r} is neither a dictionary nor null (plain "
                     f"RoPE); give one in transformers' names, e.g. "
                     f"model.rope_scaling={EXAMPLES['yarn']}")


def rope_parameters(theta: float, scaling: Optional[dict]) -> dict:
    """transformers' ``config.rope_parameters`` for base ``theta`` and a checked ``scaling``."""
    return {"rope_theta": float(theta), **(scaling or {"rope_type": "default"})}
