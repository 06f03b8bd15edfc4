"""What ``usp-eval`` scores, decided before any process group (every bad input refused
here, once): the model (a run directory's newest checkpoint, or the model group with
``model.pretrained``), the tokenizer, the validation split, every passkey case and every
position-loss window (the layout for the longest length: ``usp.run.resolve_eval``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..config import MemmapData, ModelConfig, RunConfig
from ..models.export import resolve_checkpoint
from ..models.run_records import load_data_record, load_model_config, run_root
from ..eval.grid import data_path, grid_cases, validation_tokens
from ..eval.passkey import Case


@dataclass
class EvalJob:
    """Everything the ranks need, picklable: the config (its model the one scored), the
    checkpoint to load (None: ``model.pretrained`` or a fresh init), the cases, the
    position-loss windows per length ([windows, L + 1] token ids) and where to write."""

    cfg: RunConfig
    checkpoint: Path | None
    lengths: list[int]
    cases: list[Case]
    windows: dict[int, np.ndarray]
    out: Path
    train_len: int | None
    notes: list[str]


def _recall_refusal(where: str) -> ValueError:
    return ValueError(f"{where} was trained on the synthetic recall task (data.kind=recall): "
                      "it has no text and no tokenizer, so no passkey case or validation "
                      "window can be written for it; evaluate a run trained on token files "
                      "(data=memmap data.path=PREFIX)")


def _run_model(cfg: RunConfig, notes: list[str]) -> tuple[ModelConfig, Path, dict | None]:
    """(the run's model config, the checkpoint scored, its data record): ``eval.run_dir`` a
    run directory (its newest verified checkpoint) or one of its ``checkpoints/step_K``.
    The model config and data record are the checkpoint's own when it has them (each length
    phase's RoPE and length), else the run's. ``notes`` gets the checkpoint scored and any
    newer one passed over."""
    given = Path(cfg.eval.run_dir)
    if not given.is_dir():
        raise ValueError(f"eval.run_dir={given} is not a directory; give the run directory "
                         "usp-train wrote")
    run_dir = run_root(given)
    record = load_data_record(run_dir)
    if record is not None and record["kind"] == "recall":
        raise _recall_refusal(f"the run {run_dir}")
    if load_model_config(run_dir) is None:
        raise ValueError(f"eval.run_dir={given} has no model_config.json (usp-train writes "
                         "it at the start of a run): not a usp run directory")
    try:
        step = resolve_checkpoint(given, log=notes.append)
    except ValueError as e:
        raise ValueError(f"eval.run_dir={given}: no checkpoint to score: {e}") from None
    notes.append(f"model: {step} (model only)")
    mc = load_model_config(run_dir, step)
    return replace(mc, pretrained=None), step, load_data_record(run_dir, step)


def _windows(val: np.ndarray | None, lengths: list[int], n: int, notes: list[str]) -> dict:
    """The first ``n`` windows of ``L + 1`` ids at each length (stride L), as the
    validation loss reads them; ValueError for a length the split cannot hold once."""
    if val is None:
        notes.append("no validation split (data.path's PREFIX.val): no loss by position")
        return {}
    out = {}
    for length in lengths:
        have = (len(val) - 1) // length
        if have < 1:
            raise ValueError(f"eval.lengths has {length} but the validation split holds "
                             f"{len(val)} tokens ({length + 1} needed for one window); use "
                             f"lengths up to {len(val) - 1} or a larger split (usp-prepare "
                             "--val-fraction)")
        k = min(n, have)
        out[length] = np.stack([np.asarray(val[i * length:i * length + length + 1], dtype=np.int64)
                                for i in range(k)])
    return out


def plan_eval(cfg: RunConfig, out: str | None = None) -> EvalJob:
    """The ``EvalJob`` of ``cfg`` (``cfg.eval``), or the ValueError of its first bad input."""
    ec, notes = cfg.eval, []
    checkpoint, record = None, None
    if ec.run_dir:
        mc, checkpoint, record = _run_model(cfg, notes)
        cfg = replace(cfg, model=mc)
    elif cfg.data.kind == "recall" and ec.tokenizer is None and not cfg.model.pretrained:
        raise _recall_refusal("the model (data=recall, no eval.run_dir)")
    train_len = record["seq_len"] if record else (cfg.data.seq_len if isinstance(
        cfg.data, MemmapData) else None)
    lengths = list(ec.lengths) or [train_len or cfg.data.seq_len]
    path = data_path(cfg, record)
    val = validation_tokens(path)
    cases = []
    if ec.passkey:
        cases, note = grid_cases(cfg, lengths, path, val)
        notes.append(note)
    windows = _windows(val, lengths, ec.windows, notes) if ec.position_loss else {}
    where = Path(ec.out or (run_root(ec.run_dir) if ec.run_dir else None) or out or ".")
    return EvalJob(cfg, checkpoint, lengths, cases, windows, where, train_len, notes)
