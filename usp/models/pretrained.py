"""``model.pretrained=DIR``: a local ``save_pretrained`` directory (``config.json`` +
safetensors) as the built-in model's shape, RoPE and weights.

- ``fill_model`` turns the ``model`` group as Hydra holds it into ``ModelConfig`` fields (the
  resolver's first step, ``usp.run.model_shape.resolve_model``, calls it): each shape key
  that is ``auto`` (``configs/model/pretrained.yaml``) takes the checkpoint's value; a key
  the user set must agree with it, or it is refused with both values.
- ``model.rope_theta`` may differ from the checkpoint's (a raised base); ``model.rope_scaling``
  is ``auto`` (the checkpoint's own scaling, e.g. Llama 3.1's ``llama3``; without a checkpoint:
  none), ``none`` / null (plain RoPE) or a dict (``usp/config/rope.py``). A checkpoint with a
  RoPE per layer type (Gemma 3) has them set its full layers and ``model.local_rope_theta``
  (which may differ too) its sliding ones.
- ``check_checkpoint`` refuses, before any process group, a directory without config.json or
  weights, an unmapped architecture, a damaged safetensors file (named), a shape that
  contradicts the checkpoint and a data vocabulary beyond its embedding.
- ``load_state`` reads the weights under the built-in model's parameter names (the
  checkpoint's family's state-dict adapter, ``usp.models.families``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

import torch

from ..config import ModelConfig
from ..config.model import CHECKPOINT_FIELDS, CHECKPOINT_SHAPE, PLANNED_FIELDS
from . import mxfp4
from .families import (FAMILIES, builtin_checkpoint, builtin_model, check_model,
                       check_whole, checkpoint_family, family)

AUTO = "auto"
INDEX = "model.safetensors.index.json"


# config.json keys that fix the decoder's shape: transformers fills a missing one with its
# class default (32 heads, 4096 wide, ...), which the weights then contradict
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size")


def hf_checkpoint_config(path: str | Path):
    """The transformers config of the checkpoint directory ``path``; ValueError when there is
    none, it does not parse, or (an architecture usp maps) it lacks a key of ``SHAPE_KEYS``,
    named. The text config of a checkpoint with other parts (``Family.text_model``: Gemma 3's
    ``text_config``) is read as transformers reads it, its class's defaults for a missing key:
    the released configs state only what differs from them (its tensors' shapes are checked
    against them, ``check_checkpoint``)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model.pretrained={path}: no config.json there; give a local "
                         "directory written by save_pretrained (no hub names)")
    from transformers import AutoConfig

    try:
        raw = json.loads((path / "config.json").read_text())
        hc = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model.pretrained={path}: config.json is not a transformers config "
                         f"({e})") from None
    if hc.model_type not in FAMILIES or FAMILIES[hc.model_type].text_model is not None:
        return hc  # refused as an architecture (its family), not by its keys; or read as nested
    missing = [k for k in SHAPE_KEYS if k not in raw]
    if missing:
        raise ValueError(f"model.pretrained={path}: config.json has no "
                         f"{', '.join(missing)}; transformers would fill "
                         f"{'it' if len(missing) == 1 else 'them'} with its default ("
                         + ", ".join(f"{k}={getattr(hc, k, None)}" for k in missing)
                         + "), which is not this checkpoint's shape: restore the file")
    return hc


def checkpoint_fields(path: str | Path, hf: str | None = None) -> dict:
    """``ModelConfig`` fields of the checkpoint at ``path``: its shape, ``rope_theta`` and
    ``rope_scaling`` and, for the built-in model (``hf`` None), ``arch``: what its family
    reads (``Family.read``); for the built-in model, what its family's class computes and
    the built-in model does not is refused (``Family.check_builtin``)."""
    path = Path(path)
    hc = hf_checkpoint_config(path)
    where = f"model.pretrained={path}"  # named in the refusal
    mapped = checkpoint_family(hc.model_type, where) if hf is not None else \
        builtin_checkpoint(hc.model_type, where)
    if hf is not None:
        check_whole(mapped, f"{where} is a {mapped.name} checkpoint, with model.hf={hf}")
    try:
        out = mapped.read(hc)
        if hf is None:
            mapped.check_builtin(hc)
    except ValueError as e:
        raise ValueError(f"model.pretrained={path}: {e}") from None
    out["arch"] = None if hf is not None else hc.model_type
    return out


def _same(key: str, mine, theirs, model: dict) -> bool:
    if key == "head_dim" and mine is None:  # null: dim / n_heads
        return theirs == model["dim"] // model["n_heads"]
    if isinstance(theirs, float) and isinstance(mine, (int, float)):
        return float(mine) == theirs
    return (list(mine) if isinstance(mine, (list, tuple)) else mine) == theirs


def fill_model(model: dict, data_vocab: int | None = None) -> dict:
    """The ``model`` group's values (``auto`` allowed) -> ``ModelConfig`` fields.

    With ``model.pretrained``: ``auto`` shape keys, ``rope_theta`` and ``rope_scaling`` take
    the checkpoint's values; a set shape key must equal the checkpoint's (ValueError with
    both); ``data_vocab`` (the token files' vocabulary) must fit its embedding. When no key
    is ``auto`` the directory is not read here (``usp-plan`` plans a stated shape before the
    checkpoint is on disk; ``usp-train`` compares it in ``check_checkpoint``). Without a
    checkpoint ``auto`` is refused, except ``rope_scaling`` (none) and ``vocab_size``
    (``data_vocab``)."""
    model = dict(model)
    scaling = model.get("rope_scaling")
    if isinstance(scaling, str) and scaling.lower() == "none":
        model["rope_scaling"] = None
    path = model.get("pretrained")
    # loss_chunk / mlp_tiles = auto are the planner's (PLANNED_FIELDS), not a checkpoint's
    autos = [k for k, v in model.items() if isinstance(v, str) and v == AUTO
             and k not in PLANNED_FIELDS]
    if path is None or not autos:
        if model.get("rope_scaling") == AUTO:
            model["rope_scaling"] = None
        if model.get("vocab_size") == AUTO and data_vocab is not None:
            model["vocab_size"] = data_vocab
        bad = [k for k, v in model.items() if v == AUTO and k != "vocab_size"
               and k not in PLANNED_FIELDS]
        if bad:
            raise ValueError(f"model.{bad[0]}=auto is read from a checkpoint; set "
                             f"model.pretrained=DIR or give model.{bad[0]} a value")
        return model
    have = checkpoint_fields(path, model.get("hf"))
    wrong = [f"{k}: {model[k]!r} set, {have[k]!r} in the checkpoint" for k in CHECKPOINT_SHAPE
             if model.get(k) != AUTO and not _same(k, model.get(k), have[k], model)
             and not (k == "arch" and model.get(k) is None)]
    if wrong:
        raise ValueError(f"model.pretrained={path} disagrees with the model options: "
                         f"{'; '.join(wrong)}; set those keys to auto (model=pretrained does) "
                         "or to the checkpoint's values")
    for k in CHECKPOINT_FIELDS:  # the shape, and RoPE (which may differ: it extends)
        if model.get(k) == AUTO or k == "arch":
            model[k] = have[k]
    if data_vocab is not None and data_vocab > have["vocab_size"]:
        raise ValueError(f"the data's vocabulary ({data_vocab} ids) is larger than the "
                         f"embedding of model.pretrained={path} ({have['vocab_size']} rows): "
                         "its ids would index past it; prepare the data with the "
                         "checkpoint's tokenizer (usp-prepare --tokenizer DIR)")
    return model


def pretrained_config(path: str | Path, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint at ``path`` (library use), with ``overrides``
    (e.g. ``rope_theta=8e6``, ``loss_chunk=1024``) checked as the CLI checks them."""
    base = {f.name: AUTO if f.name in CHECKPOINT_FIELDS else
            getattr(ModelConfig, f.name, None) for f in fields(ModelConfig)}
    base.update(pretrained=str(path), **overrides)
    mc = ModelConfig(**fill_model(base))
    check_model(mc)
    return mc


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of the checkpoint at ``path`` (its index's, or every
    ``*.safetensors``); ValueError when it has none."""
    path = Path(path)
    index = path / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"model.pretrained={path}: {index.name} is damaged ({e}); "
                             "restore the file") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ValueError(f"model.pretrained={path}: {INDEX} names {', '.join(missing)}, "
                             "which are not there; finish the download")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.pretrained={path} has no weights (*.safetensors); save the "
                         "model with save_pretrained (a pytorch_model.bin is not read)")
    return files


def tensor_index(path: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor of the checkpoint -> (its file, its shape), from the files' headers only;
    ValueError naming a damaged file."""
    from safetensors import safe_open

    out = {}
    for f in weight_files(path):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    out[name] = (f, tuple(st.get_slice(name).get_shape()))
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"model.pretrained: {f} is damaged ({e}); download or save it "
                             "again") from None
    return out


def expected_tensors(mc: ModelConfig, stored=()) -> dict[str, tuple[str, tuple[int, ...]]]:
    """checkpoint tensor name -> (built-in parameter name, its shape) for ``mc``, under the
    names of a checkpoint holding the tensors ``stored`` (``Family.stored_names``: a family's
    other layout). A fused expert weight the checkpoint stores per expert
    (``Family.per_expert``) is its parts instead, each with its own shape (``stacked``); one it
    stores in MXFP4 its blocks and scales (``usp.models.mxfp4``, ``packed``)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in builtin_model(mc, None).state_dict().items()}
    fam = family(mc.arch, "model.arch")
    names, apart = fam.stored_names(mc, stored), fam.per_expert(mc)
    out = {}
    for hf, usp in names.items():
        if hf in apart and hf not in stored:  # [E, ...] from E x (gate, up) or E x (down)
            experts = apart[hf]
            shape = shapes[usp][1:]  # [E, P*R, C] -> each part [R, C]
            for parts in experts:
                out.update({p: (usp, (shape[0] // len(parts), *shape[1:])) for p in parts})
        elif mxfp4.is_packed(hf, stored):  # [E, C, R] from blocks and scales
            out.update(zip(mxfp4.packed_names(hf),
                           ((usp, s) for s in mxfp4.packed_shapes(shapes[usp]))))
        else:
            out[hf] = (usp, shapes[usp])
    return out


def stacked(mc: ModelConfig, stored=()) -> dict[str, list[tuple[str, ...]]]:
    """Each built-in expert weight ``expected_tensors`` reads from per-expert tensors ->
    expert j's tensors, concatenated along dim 0 into its slice [j]."""
    fam = family(mc.arch, "model.arch")
    names = fam.stored_names(mc, stored)
    return {names[hf]: experts for hf, experts in fam.per_expert(mc).items()
            if hf in names and hf not in stored}


def packed(mc: ModelConfig, stored) -> dict[str, str]:
    """Each built-in expert weight the checkpoint holding the tensors ``stored`` has in MXFP4
    -> its name there (without the ``_blocks`` / ``_scales`` suffix)."""
    names = family(mc.arch, "model.arch").stored_names(mc, stored)
    return {usp: hf for hf, usp in names.items() if mxfp4.is_packed(hf, stored)}


def check_checkpoint(mc: ModelConfig) -> None:
    """Refuse (ValueError) a ``model.pretrained`` the built-in model ``mc`` cannot start from:
    its config disagrees with ``mc``'s shape, a file is damaged, a tensor is missing or of
    another shape. Reads config.json and the safetensors headers only."""
    if mc.pretrained is None or mc.hf is not None:
        return
    fill_model({**asdict(mc), "rope_theta": AUTO, "rope_scaling": AUTO})
    have = tensor_index(mc.pretrained)
    bad = []
    for hf, (usp, shape) in expected_tensors(mc, have).items():
        if hf not in have:
            bad.append(f"{hf} missing")
        elif have[hf][1] != shape:
            bad.append(f"{hf} is {list(have[hf][1])} in {have[hf][0].name}, {usp} is {list(shape)}")
    if bad:
        raise ValueError(f"model.pretrained={mc.pretrained} does not fit the model: "
                         f"{'; '.join(bad[:4])}" + (f" (and {len(bad) - 4} more)" if len(bad) > 4
                                                   else "") + "; restore the checkpoint")


def start_notes(mc: ModelConfig, seq_len: int) -> list[str]:
    """What a run from ``mc.pretrained`` says once at its start: a changed ``rope_theta``
    ("rope_theta 500000 -> 8000000"), a changed scaling, a changed ``local_rope_theta``,
    each naming the layers it changes when the checkpoint has a RoPE per layer type
    ("rope_theta 1000000 -> 2000000 (full_attention layers)"), and a warning when the
    scaling's ``original_max_position_embeddings`` is at or above ``seq_len`` (nothing is
    extended)."""
    if mc.pretrained is None:
        return []
    have = checkpoint_fields(mc.pretrained, mc.hf)
    notes = [f"model.pretrained={mc.pretrained} ({have['arch'] or mc.hf})"]
    # with a base of their own on the sliding layers, rope_theta / rope_scaling are the full ones'
    full = " (full_attention layers)" if mc.local_rope_theta is not None else ""
    if have["rope_theta"] != mc.rope_theta:
        notes.append(f"rope_theta {have['rope_theta']:.10g} -> {mc.rope_theta:.10g}{full}")
    if have["rope_scaling"] != mc.rope_scaling:
        notes.append(f"rope_scaling {have['rope_scaling']} -> {mc.rope_scaling}{full}")
    if have["local_rope_theta"] != mc.local_rope_theta:  # null: as the full layers
        old, new = (f"{x:.10g}" if x is not None else "null"
                    for x in (have["local_rope_theta"], mc.local_rope_theta))
        notes.append(f"local_rope_theta {old} -> {new} (sliding_attention layers)")
    old = (mc.rope_scaling or {}).get("original_max_position_embeddings")
    if old is not None and old >= seq_len:
        notes.append(f"warning: model.rope_scaling.original_max_position_embeddings={old} >= "
                     f"data.seq_len={seq_len}: this run extends nothing beyond the original "
                     "context; raise data.seq_len or lower the scaling")
    return notes


def load_state(mc: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as the built-in model's state dict (fp32, whole tensors);
    experts stored apart are stacked (``stacked``), those in MXFP4 dequantized (``packed``)."""
    from safetensors import safe_open

    stored = tensor_index(mc.pretrained)  # headers only
    names = {hf: usp for hf, (usp, _) in expected_tensors(mc, stored).items()}
    apart, quantized = stacked(mc, stored), packed(mc, stored)
    out, parts = {}, {}
    for f in weight_files(mc.pretrained):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name in names and names[name] in apart:  # one expert's part
                    parts[name] = st.get_tensor(name).float()
                elif name in names and names[name] in quantized:  # MXFP4 blocks or scales
                    parts[name] = st.get_tensor(name)
                elif name in names:
                    out[names[name]] = st.get_tensor(name).float()
    for usp, experts in apart.items():  # E x [R, C] parts -> [E, P*R, C]
        out[usp] = torch.stack([torch.cat([parts[p] for p in each]) for each in experts])
    for usp, name in quantized.items():  # blocks [E, R, C/32, 16], scales -> [E, C, R]
        out[usp] = mxfp4.dequantize(*(parts[p] for p in mxfp4.packed_names(name)))
    return out
