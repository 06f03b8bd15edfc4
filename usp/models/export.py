"""``usp-export``: a usp checkpoint -> a directory transformers' ``from_pretrained`` loads.

A training run writes its checkpoints as ``usp.models.checkpoint`` does:
``run_dir/checkpoints/step_K/`` holds the DCP shards of ``{"model": ..., "optim": ...}``
(parameter names as ``model.state_dict()`` has them) and a manifest. At its start, rank 0
records ``run_dir/model_config.json`` (the ``model`` group: built-in or transformers), for
a transformers model its config in ``run_dir/hf_config/``, and the data's tokenizer in
``run_dir/tokenizer/`` when it has one (``usp.models.run_records``). ``export_checkpoint``
verifies the checkpoint, builds the transformers model (the built-in model as its family's,
``usp.models.families``), loads the ``model`` entries (not the optimizer) in one process and
writes safetensors with ``save_pretrained``, the tokenizer beside them.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..config import ModelConfig
from .checkpoint import step_dirs, verify_checkpoint
from .families import export_notes, hf_equivalent, hf_names, zero_filled
from .hf_model import hf_config
from .run_records import (HF_CONFIG_DIR, MODEL_CONFIG, TOKENIZER_DIR, load_data_record,
                          load_model_config)


def resolve_checkpoint(path: str | Path, log=lambda line: None) -> Path:
    """The checkpoint ``path`` names, verified against its manifest: ``path`` itself (a
    ``step_K``), or the newest ``step_K`` of the run directory ``path`` that verifies
    (``log``: one line per damaged newer one passed over). ValueError when there is none."""
    path = Path(path)
    if (path / ".metadata").is_file():
        why = verify_checkpoint(path)
        if why is not None:
            raise ValueError(f"checkpoint {path} cannot be trusted: {why}; export an earlier "
                             "step_K or restore the files")
        return path
    if not path.is_dir():
        raise ValueError(f"{path} does not exist; give a run directory or its "
                         "checkpoints/step_K")
    steps = step_dirs(path)
    if not steps:
        raise ValueError(f"{path} is neither a checkpoint (no .metadata) nor a run directory "
                         f"with checkpoints ({path / 'checkpoints'} has no step_K); give "
                         "the run directory usp-train wrote")
    whys = []
    for step in steps:
        whys.append(verify_checkpoint(step))
        if whys[-1] is None:
            for newer, why in zip(steps, whys[:-1]):
                log(f"checkpoint {newer} is damaged ({why}); exported {step.name}")
            return step
    raise ValueError(f"none of the {len(steps)} checkpoints under {path / 'checkpoints'} "
                     f"verifies (the newest, {steps[0].name}: {whys[0]}); restore its files")


# ---- export: a checkpoint -> a directory from_pretrained loads ----------------------------

@dataclass(frozen=True)
class Export:
    """What ``export_checkpoint`` wrote: ``model`` (the transformers model, as saved) to
    ``out_dir`` from checkpoint ``step``; ``tokenizer``: whether its files are there too;
    ``notes``: one line each for what a user of the export should know."""

    model: object
    out_dir: Path
    step: Path
    tokenizer: bool
    notes: tuple[str, ...] = ()

    def summary(self) -> list[str]:
        n = sum(p.numel() for p in self.model.parameters())
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return [f"wrote {type(self.model).__name__} ({n:,} parameters, {dtype}) from "
                f"{self.step} to {self.out_dir}", *self.notes]


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, config=None,
                      dtype: torch.dtype | None = None) -> Export:
    """Export ``checkpoint`` (a ``step_K`` directory or a run directory: its newest one) as
    a Hugging Face model directory ``out_dir`` (``config.json``, ``model.safetensors``,
    ``generation_config.json`` and the run's tokenizer files when it has them).

    The model: the run's ``model_config.json`` says which. The built-in model is mapped to
    its family's transformers class (``usp.models.families.hf_equivalent``: ``model.arch``,
    or the text model's family for a checkpoint whose text model sits beside other parts,
    which are not carried over and a note says so; else the one its windows export as); a
    transformers model (``model.hf``) is built from ``config``: a ``PretrainedConfig``, or a
    directory with ``config.json``; default: the run's ``hf_config``. ``dtype``: cast the
    weights (default: as stored, fp32).

    Everything is checked before anything is written, each problem a ValueError: the
    checkpoint fails its manifest, the model config is missing or not buildable, a weight is
    missing, left over or of another shape, ``out_dir`` is not empty or not writable. The
    files go to a temporary directory beside ``out_dir``, renamed to it when complete.
    """
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    notes: list[str] = []
    step = resolve_checkpoint(checkpoint, log=notes.append)
    run_dir = step.parent.parent
    mc = load_model_config(run_dir, step)  # the checkpoint's own (its phase's), else the run's
    tokenizer = _run_tokenizer(run_dir, notes)
    facts = load_data_record(run_dir, step) or {}  # the trained length, the data's EOS
    if mc is not None and mc.hf is None:
        if config is not None:
            raise ValueError(f"a config (--config) is for runs of a transformers model, but "
                             f"{run_dir / MODEL_CONFIG} says this run trained the built-in "
                             "model (hf: null); export it without one")
        hc = hf_config(hf_equivalent(mc), facts.get("seq_len"))
        names, zeros = hf_names(mc), zero_filled(mc)
        notes.extend(export_notes(mc))  # parts of the checkpoint not carried over
    else:
        hc, names, zeros = _hf_run_config(run_dir, mc, config), None, []
    if mc is not None and mc.rope == "per_document":
        notes.append("model.rope=per_document: positions restarted at each document in "
                     "training; the export computes what usp did on one document at a time "
                     "(position_ids from 0): split packed rows into their documents")
    from transformers import AutoModelForCausalLM

    hc.use_cache = True  # training ran without a KV cache; generation wants one
    if tokenizer is not None:
        _token_ids(hc, tokenizer)
    elif mc is not None and mc.pretrained is None:  # transformers' default ids mean nothing here
        hc.eos_token_id = hc.bos_token_id = hc.pad_token_id = None
    if facts.get("eos_token_id") is not None:  # the EOS the data ends its documents with
        hc.eos_token_id = facts["eos_token_id"]
        hc.pad_token_id = hc.eos_token_id if hc.pad_token_id is None else hc.pad_token_id
    model = AutoModelForCausalLM.from_config(hc, dtype=torch.float32)
    _load_weights(model, step, names, zeros)
    if dtype is not None:
        model.to(dtype)
    _write(out_dir, model, tokenizer)
    return Export(model.eval(), out_dir, step, tokenizer is not None, tuple(notes))


def _check_out_dir(out_dir: Path) -> None:
    """Refuse an ``out_dir`` that holds files, or whose place cannot be written."""
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty directory; give a new or "
                         "empty OUT_DIR (nothing there is overwritten)")
    parent = out_dir.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {out_dir}: {parent} is not a writable directory; "
                         "choose an OUT_DIR in one")


def _hf_run_config(run_dir: Path, mc: ModelConfig | None, config):
    """The transformers config of a run of a transformers model: ``config`` (a config or a
    directory), else ``run_dir/hf_config``."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config)  # the export sets its cache and token ids
    where = Path(config) if config is not None else run_dir / HF_CONFIG_DIR
    if not (where / "config.json").is_file():
        if config is None and mc is None:
            raise ValueError(f"{run_dir} has no model config: neither {MODEL_CONFIG} (written "
                             f"by usp-train at the start of a run) nor {HF_CONFIG_DIR}/; for a "
                             "transformers model pass --config DIR (its config.json)")
        raise ValueError(f"no config.json in {where}; pass the model's config (--config: a "
                         "directory with config.json)")
    return AutoConfig.from_pretrained(str(where), local_files_only=True)


def _run_tokenizer(run_dir: Path, notes: list[str]):
    """The run's tokenizer (``run_dir/tokenizer``), or None with a note saying why."""
    path = run_dir / TOKENIZER_DIR
    if not path.is_dir():
        notes.append(f"no tokenizer: the run has no {path} (its data had none: byte tokens, "
                     "the synthetic recall task, or a run from before usp-train copied it); "
                     "the export holds the model only")
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"the run's tokenizer {path} does not load ({e}); restore it from "
                         "the data's PREFIX.tokenizer directory") from None
    notes.append(f"tokenizer: copied from {path}")
    return tok


def _token_ids(hc, tokenizer) -> None:
    """Set ``hc``'s eos/bos/pad token ids from the tokenizer (pad: eos when it has none),
    so ``generate`` needs no ids passed; refuse a tokenizer larger than the model's vocab."""
    if len(tokenizer) > hc.vocab_size:
        raise ValueError(f"the run's tokenizer has {len(tokenizer)} tokens but the model's "
                         f"vocab_size is {hc.vocab_size}: ids past it have no embedding; "
                         f"train with model.vocab_size >= {len(tokenizer)}")
    eos = tokenizer.eos_token_id
    hc.eos_token_id, hc.bos_token_id = eos, tokenizer.bos_token_id
    hc.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos


def _load_weights(model, step: Path, names: dict[str, str] | None, zeros: list[str]) -> None:
    """Fill ``model`` in place from checkpoint ``step``'s ``model.<name>`` tensors, ``names``
    mapping a stored name to the model's (None: the same names), ``zeros`` set to zero.
    ValueError unless every weight of the model is filled once, with its shape."""
    state = model.state_dict()  # shares storage with the parameters
    names = {k: k for k in state} if names is None else names
    stored = {k.removeprefix("model."): md for k, md in _stored(step).items()
              if k.startswith("model.")}
    arch = type(model).__name__
    problems = []
    missing = sorted(k for k in names if k not in stored)
    if missing:
        problems.append(f"{len(missing)} weights the model config asks for are not in the "
                        f"checkpoint (first: {missing[:3]})")
    extra = sorted(k for k in stored if k not in names)
    if extra:
        problems.append(f"{len(extra)} weights of the checkpoint have no place in the model "
                        f"(first: {extra[:3]})")
    shapes = [f"{k} {tuple(stored[k].size)} stored, {tuple(state[h].shape)} in {arch}"
              for k, h in names.items() if k in stored and tuple(stored[k].size) != state[h].shape]
    if shapes:
        problems.append(f"shapes differ: {'; '.join(shapes[:3])}")
    tied = {t for t in state if _shares_storage(state[t], state, set(names.values()))}
    unfilled = sorted(set(state) - set(names.values()) - set(zeros) - tied)
    if unfilled:
        problems.append(f"{arch} weights nothing fills: {unfilled[:3]}")
    if problems:
        raise ValueError(f"checkpoint {step} does not fit {arch}: {'; '.join(problems)}; is "
                         "the model config the one that was trained?")
    want = {k: state[h] for k, h in names.items()}
    with warnings.catch_warnings():  # DCP warns that one process is assumed: it is meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": want}, checkpoint_id=str(step), no_dist=not dist.is_initialized())
    with torch.no_grad():
        for k in zeros:
            state[k].zero_()


def load_model(step: str | Path, model) -> None:
    """Model-only load: fill ``model`` (unsharded, the architecture the run trained: the
    built-in ``Transformer`` or its transformers model) from checkpoint ``step``'s
    ``model.<name>`` tensors; no optimizer, no schedule. Collective when a process group
    is up (every rank reads alike). ValueError when the checkpoint does not fit."""
    _load_weights(model, Path(step), None, [])


def _shares_storage(t: torch.Tensor, state: dict, filled: set[str]) -> bool:
    """``t`` is a tied view of a weight that is filled (``lm_head`` of tied embeddings)."""
    return any(state[k].data_ptr() == t.data_ptr() for k in filled if state[k] is not t)


def _stored(step: Path) -> dict:
    """Flattened name -> DCP metadata of each tensor a checkpoint holds (``model.<param>``)."""
    return dict(dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata)


def _write(out_dir: Path, model, tokenizer) -> None:
    """``save_pretrained`` the model (and tokenizer) into a temporary directory beside
    ``out_dir``, renamed to ``out_dir`` when complete; nothing is left on failure."""
    from transformers.utils import logging as hf_logging

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # a directory as mkdir makes it, not mkdtemp's private one
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one small shard: no "Writing model shards" bar
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out_dir.is_dir():  # empty (checked before)
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar:
            hf_logging.enable_progress_bar()


# ---- the command: usp-export RUN_DIR_OR_STEP_DIR OUT_DIR ----------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="usp-export",
        description="Export a usp checkpoint (the built-in model, as its family's transformers "
                    "class, or a transformers model) as a "
                    "directory AutoModelForCausalLM.from_pretrained loads, with the run's "
                    "tokenizer when it has one.")
    ap.add_argument("checkpoint", help="run_dir (its newest checkpoint) or run_dir/checkpoints/step_K")
    ap.add_argument("out_dir", help="directory to create (new or empty): config.json, "
                                    "model.safetensors, tokenizer files")
    ap.add_argument("--config", default=None,
                    help="transformers models only: directory with the model's config.json "
                         "(default: run_dir/hf_config)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="cast the weights (default: as stored, fp32)")
    args = ap.parse_args(argv)
    try:
        done = export_checkpoint(args.checkpoint, args.out_dir, config=args.config,
                                 dtype=DTYPES.get(args.dtype))
    except (ValueError, OSError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    for line in done.summary():
        print(f"{ap.prog}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
