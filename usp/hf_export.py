"""A usp checkpoint of a Hugging Face model -> a directory ``from_pretrained`` loads.

A training run of an HF model writes its checkpoints as ``usp.train.checkpoint`` does:
``run_dir/checkpoints/step_K/`` holds the DCP shards of ``{"model": ..., "optim": ...}``
(parameter names as ``model.state_dict()`` has them) and a manifest; the model's config
lives in ``run_dir/hf_config/`` (``config.save_pretrained``, see ``save_config``).
``export_checkpoint`` verifies the checkpoint, builds the model from the config, loads the
``model`` entries (not the optimizer) in one process and writes safetensors with
``save_pretrained``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .train.checkpoint import latest_checkpoint, verify_checkpoint

HF_CONFIG_DIR = "hf_config"  # under the run directory


def save_config(config, run_dir: str | Path) -> Path:
    """Write an HF ``config`` where ``export_checkpoint`` looks for it: ``run_dir/hf_config``."""
    out = Path(run_dir) / HF_CONFIG_DIR
    config.save_pretrained(out)
    return out


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` when it is a checkpoint (``step_K``), else the newest verified checkpoint of
    the run directory ``path``; ValueError when there is none."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    found = latest_checkpoint(path, log=lambda line: None)
    if found is None:
        raise ValueError(f"{path} is neither a checkpoint (no .metadata) nor a run directory "
                         f"with one under {path / 'checkpoints'}")
    return found


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, config=None,
                      dtype: torch.dtype | None = None):
    """Export ``checkpoint`` (a ``step_K`` directory or a run directory: its newest one) as
    a Hugging Face model directory ``out_dir``; returns the loaded model.

    ``config``: a ``PretrainedConfig``, or a directory with ``config.json``; default: the
    run's ``hf_config`` (``step_K/../../hf_config``). ``dtype``: cast the weights (default:
    as stored). Raises ValueError when the checkpoint fails its manifest or lacks a weight
    of the model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    step = resolve_checkpoint(checkpoint)
    why = verify_checkpoint(step)
    if why is not None:
        raise ValueError(f"checkpoint {step} cannot be trusted: {why}")
    if config is None:
        config = step.parent.parent / HF_CONFIG_DIR
    if isinstance(config, (str, Path)):
        if not (Path(config) / "config.json").is_file():
            raise ValueError(f"no config.json in {config}; pass the model's config (a "
                             "directory with config.json, or a PretrainedConfig)")
        config = AutoConfig.from_pretrained(str(config))
    model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    stored = _stored_keys(step)
    missing = sorted(f"model.{k}" for k in state if f"model.{k}" not in stored)
    if missing:
        raise ValueError(f"checkpoint {step} lacks {len(missing)} weights of "
                         f"{type(model).__name__} (first: {missing[:3]}); is config the "
                         "model that was trained?")
    one_process = not dist.is_initialized()
    with warnings.catch_warnings():  # DCP warns that one process is assumed: it is meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(step), no_dist=one_process)  # in place
    model.load_state_dict(state)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def _stored_keys(step: Path) -> set[str]:
    """Flattened names of the tensors a DCP checkpoint holds (``model.<param>``, ...)."""
    meta = dcp.FileSystemReader(str(step)).read_metadata()
    return set(meta.state_dict_metadata)
