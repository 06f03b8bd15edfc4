"""What a run records for export (rank 0, at the start of the run): the model group's fields
(``model_config.json``), a transformers model's config (``hf_config/``), the tokenizer
(``tokenizer/``: the data's, else a pretrained checkpoint's tokenizer files) and the
data it read (``data_record.json``: its kind, the trained length, the data's EOS id, the token
files; for the export and ``usp-eval``), all under the run directory; and reading them back.
Each checkpoint also keeps its own ``model_config.json`` and ``data_record.json`` (the phase
that wrote it: a run of length phases changes RoPE and length), read before the run's."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import asdict
from pathlib import Path

from ..config import ModelConfig

HF_CONFIG_DIR = "hf_config"  # under the run directory: a transformers model's config
MODEL_CONFIG = "model_config.json"  # under the run directory: the model group's fields
TOKENIZER_DIR = "tokenizer"  # under the run directory: the data's tokenizer, when it has one
DATA_RECORD = "data_record.json"  # under the run directory: what the run read (export, usp-eval)
# the files of a Hugging Face tokenizer (save_pretrained), without the model's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")

def save_config(config, run_dir: str | Path) -> Path:
    """Write an HF ``config`` where ``export_checkpoint`` looks for it: ``run_dir/hf_config``."""
    out = Path(run_dir) / HF_CONFIG_DIR
    config.save_pretrained(out)
    return out


def run_root(path: str | Path) -> Path:
    """The run directory of ``path``: ``path`` itself, or for a checkpoint
    (``RUN/checkpoints/step_K``, holding ``.metadata``) the run directory above it."""
    path = Path(path)
    return path.parent.parent if (path / ".metadata").is_file() else path


def _write(out: Path, text: str) -> Path:
    """``text`` to ``out`` atomically (a temporary file renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return out


def _record(run_dir: str | Path, name: str, checkpoint: str | Path | None) -> Path:
    """Where record ``name`` is read: the checkpoint's own copy (written with it, so that a
    run of length phases keeps each phase's model and length), else the run directory's."""
    if checkpoint is not None and (Path(checkpoint) / name).is_file():
        return Path(checkpoint) / name
    return Path(run_dir) / name


def save_record(run_dir: str | Path, name: str, text: str) -> Path:
    """Write record ``name`` (``MODEL_CONFIG``, ``DATA_RECORD``) under ``run_dir``, atomically."""
    return _write(Path(run_dir) / name, text)


def model_config_text(mc: ModelConfig) -> str:
    """``mc``'s fields as ``model_config.json`` holds them."""
    return json.dumps(asdict(mc), indent=1) + "\n"


def save_model_config(mc: ModelConfig, run_dir: str | Path) -> Path:
    """Write ``mc``'s fields to ``run_dir/model_config.json`` (atomically): which model the
    run trains, the built-in one (``hf: null``) or a transformers one."""
    return save_record(run_dir, MODEL_CONFIG, model_config_text(mc))


def load_model_config(run_dir: str | Path, checkpoint: str | Path | None = None
                      ) -> ModelConfig | None:
    """The ``ModelConfig`` in ``model_config.json``: the ``checkpoint``'s (a ``step_K``)
    when it has one, else ``run_dir``'s; None when the file is absent, ValueError when it is
    not one this usp can build."""
    path = _record(run_dir, MODEL_CONFIG, checkpoint)
    if not path.is_file():
        return None
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}); restore it from the run's config") from None
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ValueError(f"{path} has model fields this usp does not know ({', '.join(unknown)})"
                         ": they may change what the model computes; export with the usp "
                         "version that trained the run")
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a valid model config: {e}") from None


def save_tokenizer(src: str | Path, run_dir: str | Path) -> Path:
    """Copy the tokenizer directory ``src`` (``AutoTokenizer.from_pretrained`` loads it) to
    ``run_dir/tokenizer``, replacing an earlier copy only once the new one is complete."""
    out = Path(run_dir) / TOKENIZER_DIR
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def save_tokenizer_files(src: str | Path, run_dir: str | Path) -> Path | None:
    """Copy the tokenizer files of a model directory ``src`` (not its weights) to
    ``run_dir/tokenizer``; None when ``src`` has no ``tokenizer_config.json``."""
    src = Path(src)
    if not (src / "tokenizer_config.json").is_file():
        return None
    out = Path(run_dir) / TOKENIZER_DIR
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def data_record_text(data, eos_token_id: int | None) -> str:
    """``data_record.json``: the data's ``kind``, ``seq_len`` (the export's
    ``max_position_embeddings``), its EOS id (the export's ``eos_token_id``) and, for token
    files, the first source's ``path`` (``usp-eval`` finds the validation split and the
    tokenizer from it)."""
    sources = data.sources() if hasattr(data, "sources") else []
    record = {"kind": data.kind, "seq_len": data.seq_len, "eos_token_id": eos_token_id,
              "path": str(Path(sources[0][0]).resolve()) if sources else None}
    return json.dumps(record, indent=1) + "\n"


def save_data_record(data, run_dir: str | Path, eos_token_id: int | None) -> Path:
    """Write ``run_dir/data_record.json`` (``data_record_text``)."""
    return save_record(run_dir, DATA_RECORD, data_record_text(data, eos_token_id))


def load_data_record(run_dir: str | Path, checkpoint: str | Path | None = None) -> dict | None:
    """``save_data_record``'s record: the ``checkpoint``'s (a ``step_K``) when it has one,
    else ``run_dir``'s; None when there is none."""
    path = _record(run_dir, DATA_RECORD, checkpoint)
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}); delete it (usp-eval then needs "
                         "data=memmap data.path=PREFIX)") from None
