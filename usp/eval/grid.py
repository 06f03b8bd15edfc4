"""A config's passkey grid: the model's tokenizer, the haystack (the validation split's text
or the protocol's filler) and every case of ``eval.lengths`` x ``eval.depths``. Read by
``usp-eval``'s plan and by the trainer's periodic passkey score, so both score the same
cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import MemmapData, RunConfig
from ..data.dataset import validation_prefix
from ..data.files import DTYPES, data_paths, read_meta, tokenizer_dir
from ..models.run_records import TOKENIZER_DIR, run_root
from .chat import chat_frame
from .passkey import ByteTokenizer, Case, HFTokenizer, filler_haystack, passkey_cases, text_haystack


def data_path(cfg: RunConfig, record: dict | None) -> str | None:
    """The token files whose validation split gives text and windows: ``data.path`` (a
    blend's first source), else the run's recorded path (also under a memmap data group
    that names no files, as a recipe's ``data=memmap`` does); ValueError (data.path is not
    set) for memmap data without files or a record."""
    data = cfg.data
    if isinstance(data, MemmapData) and (data.path or data.blend or record is None):
        return data.sources()[0][0]
    return None if record is None else record.get("path")


def tokenizer(cfg: RunConfig, data_path: str | None):
    """The model's tokenizer: ``eval.tokenizer``, the run's copy, the data's (bytes or its
    ``.tokenizer``), or the ``model.pretrained`` directory's."""
    given = cfg.eval.tokenizer
    where = []
    if given is None and cfg.eval.run_dir:
        where.append(run_root(cfg.eval.run_dir) / TOKENIZER_DIR)
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


def validation_tokens(data_path: str | None) -> np.ndarray | None:
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


def grid_cases(cfg: RunConfig, lengths: list[int], data_path: str | None,
               val: np.ndarray | None) -> tuple[list[Case], str]:
    """(every passkey case of ``lengths`` x ``eval.depths``, the note that says which
    haystack): ``eval.haystack`` (``auto``: the validation split ``val`` when there is one
    and the data is not conversations, else the filler); ValueError for a bad input (no
    tokenizer, a key it cannot encode, a length the text cannot hold)."""
    ec = cfg.eval
    tok = tokenizer(cfg, data_path)
    text = ec.haystack == "text" or (ec.haystack == "auto" and val is not None
                                     and not chat_data(data_path))
    if text and val is None:
        raise ValueError("eval.haystack=text needs a validation split (PREFIX.val of "
                         "data.path); none found: use eval.haystack=filler")
    hay = text_haystack(val) if text else filler_haystack(tok)
    frame = chat_frame(tok) if ec.chat else None
    cases = passkey_cases(tok, lengths, ec.depths, ec.per_cell, ec.key_digits, ec.seed,
                          cfg.model.vocab_size, hay, frame)
    form = ", asked in chat form" if ec.chat else ""
    return cases, f"passkey haystack: {'validation text' if text else 'filler sentences'}{form}"


def chat_data(data_path: str | None) -> bool:
    """Whether ``data_path``'s token files hold rendered conversations (``usp-prepare`` on
    chat records: ``"chat": true``): their text, chat markers and all, is no haystack, so
    ``eval.haystack=auto`` takes the filler."""
    if data_path is None or not data_paths(data_path)[1].is_file():
        return False
    return bool(read_meta(data_paths(data_path)[1], Path(data_path)).get("chat"))


def passkey_lengths(cfg: RunConfig, train_len: int) -> list[int]:
    """The lengths the trainer scores (``eval.during_training``): ``eval.lengths``, or the
    training length."""
    return list(cfg.eval.lengths) or [train_len]


def training_cases(cfg: RunConfig, train_len: int) -> list[Case]:
    """The grid ``usp-eval`` scores for this run (its tokenizer, haystack and seeds), at
    ``passkey_lengths``; ValueError for a bad input."""
    path = data_path(cfg, None)
    return grid_cases(cfg, passkey_lengths(cfg, train_len), path, validation_tokens(path))[0]
