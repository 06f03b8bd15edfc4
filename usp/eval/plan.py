"""What ``usp-eval`` scores, decided before any process group (every bad input refused
here, once): the model (a run directory's newest checkpoint, or the model group with
``model.pretrained``), the tokenizer, the validation split, every passkey case and every
position-loss window (the layout for the longest length: ``usp.run.resolve_eval``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..config import MemmapData, ModelConfig, RunConfig
from ..data.dataset import validation_prefix
from ..data.files import DTYPES, data_paths, read_meta, tokenizer_dir
from ..models.export import resolve_checkpoint
from ..models.run_records import TOKENIZER_DIR, load_data_record, load_model_config
from .passkey import ByteTokenizer, Case, HFTokenizer, filler_haystack, passkey_cases, text_haystack


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
    """(the run's model config, its newest verified checkpoint, its data record); ``notes``
    gets the checkpoint scored and any newer one passed over."""
    run_dir = Path(cfg.eval.run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"eval.run_dir={run_dir} is not a directory; give the run directory "
                         "usp-train wrote")
    record = load_data_record(run_dir)
    if record is not None and record["kind"] == "recall":
        raise _recall_refusal(f"the run {run_dir}")
    mc = load_model_config(run_dir)
    if mc is None:
        raise ValueError(f"eval.run_dir={run_dir} has no model_config.json (usp-train writes "
                         "it at the start of a run): not a usp run directory")
    try:
        step = resolve_checkpoint(run_dir, log=notes.append)
    except ValueError as e:
        raise ValueError(f"eval.run_dir={run_dir}: no checkpoint to score: {e}") from None
    notes.append(f"model: {step} (model only)")
    return replace(mc, pretrained=None), step, record


def _data_path(cfg: RunConfig, record: dict | None) -> str | None:
    """The token files whose validation split gives text and windows: ``data.path`` (a
    blend's first source), else the run's recorded path."""
    if isinstance(cfg.data, MemmapData):
        return cfg.data.sources()[0][0]
    return None if record is None else record.get("path")


def _tokenizer(cfg: RunConfig, data_path: str | None):
    """The model's tokenizer: ``eval.tokenizer``, the run's copy, the data's (bytes or its
    ``.tokenizer``), or the ``model.pretrained`` directory's."""
    given = cfg.eval.tokenizer
    where = []
    if given is None and cfg.eval.run_dir:
        where.append(Path(cfg.eval.run_dir) / TOKENIZER_DIR)
    if given is None and data_path is not None:
        meta = read_meta(data_paths(data_path)[1], Path(data_path))
        if str(meta["tokenizer"]).startswith("bytes"):
            return ByteTokenizer()
        where.append(tokenizer_dir(data_path))
    if given is None and cfg.model.pretrained:
        where.append(Path(cfg.model.pretrained))
    if given == "bytes":
        return ByteTokenizer()
    where = [Path(given)] if given is not None else where
    for path in where:
        if path.is_dir() and any(path.glob("tokenizer*")):
            from transformers import AutoTokenizer

            return HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    raise ValueError(f"no tokenizer for the model (looked in {[str(p) for p in where] or 'none'}"
                     "); pass eval.tokenizer=bytes or eval.tokenizer=DIR (a tokenizer "
                     "directory), or data=memmap data.path=PREFIX of its token files")


def _validation_tokens(data_path: str | None) -> np.ndarray | None:
    """The validation split's ids (memory-mapped), or None without one."""
    if data_path is None:
        return None
    prefix = validation_prefix(data_path)
    bin_path, json_path = data_paths(prefix)
    if not bin_path.is_file():
        return None
    meta = read_meta(json_path, Path(prefix))
    return np.memmap(bin_path, dtype=DTYPES[meta["dtype"]], mode="r",
                     shape=(int(meta["num_tokens"]),))


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
    data_path = _data_path(cfg, record)
    val = _validation_tokens(data_path)
    cases = []
    if ec.passkey:
        tok = _tokenizer(cfg, data_path)
        text = ec.haystack == "text" or (ec.haystack == "auto" and val is not None)
        if text and val is None:
            raise ValueError("eval.haystack=text needs a validation split (PREFIX.val of "
                             "data.path); none found: use eval.haystack=filler")
        hay = text_haystack(val) if text else filler_haystack(tok)
        cases = passkey_cases(tok, lengths, ec.depths, ec.per_cell, ec.key_digits, ec.seed,
                              cfg.model.vocab_size, hay)
        notes.append(f"passkey haystack: {'validation text' if text else 'filler sentences'}")
    windows = _windows(val, lengths, ec.windows, notes) if ec.position_loss else {}
    where = Path(ec.out or ec.run_dir or out or ".")
    return EvalJob(cfg, checkpoint, lengths, cases, windows, where, train_len, notes)
