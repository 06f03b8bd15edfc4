"""Hugging Face model files for usp runs: the transformers config and model of a
``ModelConfig`` (``model.hf``), the run's config directory, and a usp checkpoint -> a
directory ``from_pretrained`` loads.

A training run of an HF model writes its checkpoints as ``usp.models.checkpoint`` does:
``run_dir/checkpoints/step_K/`` holds the DCP shards of ``{"model": ..., "optim": ...}``
(parameter names as ``model.state_dict()`` has them) and a manifest; the model's config
lives in ``run_dir/hf_config/`` (``config.save_pretrained``, see ``save_config``).
``export_checkpoint`` verifies the checkpoint, builds the model from the config, loads the
``model`` entries (not the optimizer) in one process and writes safetensors with
``save_pretrained``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..config import ModelConfig
from .checkpoint import latest_checkpoint, verify_checkpoint

HF_CONFIG_DIR = "hf_config"  # under the run directory
_CONFIG_CLASS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}
# transformers config key -> the ModelConfig field it comes from (for mismatch messages)
_FIELD = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
          "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
          "intermediate_size": "ffn_dim", "rms_norm_eps": "norm_eps",
          "tie_word_embeddings": "tie_embeddings", "sliding_window": "sliding_window",
          "layer_types": "full_attention_every"}


def hf_config(mc: ModelConfig):
    """The transformers config (``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig`` for
    ``mc.hf``) of ``mc``'s shape: no KV cache, no attention dropout. Windows: qwen2 marks
    each layer in ``layer_types`` (``mc.layer_window``); mistral windows every layer."""
    import transformers

    if mc.hf not in _CONFIG_CLASS:
        raise ValueError(f"model.hf={mc.hf!r} is not one of {', '.join(_CONFIG_CLASS)}")
    kw = dict(vocab_size=mc.vocab_size, hidden_size=mc.dim, intermediate_size=mc.ffn_dim,
              num_hidden_layers=mc.n_layers, num_attention_heads=mc.n_heads,
              num_key_value_heads=mc.n_kv_heads, rms_norm_eps=mc.norm_eps,
              tie_word_embeddings=mc.tie_embeddings, use_cache=False, attention_dropout=0.0,
              rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta})
    if mc.hf == "qwen2":
        kw.update(use_sliding_window=mc.sliding_window is not None,
                  sliding_window=mc.sliding_window,
                  layer_types=["full_attention" if mc.layer_window(i) is None
                               else "sliding_attention" for i in range(mc.n_layers)])
    elif mc.hf == "mistral":
        kw.update(sliding_window=mc.sliding_window)
    return getattr(transformers, _CONFIG_CLASS[mc.hf])(**kw)


def check_pretrained(mc: ModelConfig) -> None:
    """Refuse ``mc.pretrained`` (ValueError) unless it is a local model directory of
    architecture ``mc.hf`` and exactly ``mc``'s shape."""
    from transformers import AutoConfig

    path = Path(mc.pretrained)
    if not (path / "config.json").is_file():
        raise ValueError(f"model.pretrained={path}: no config.json there; give a directory "
                         "written by save_pretrained (local files only, no hub names)")
    have = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if have.model_type != mc.hf:
        raise ValueError(f"model.pretrained={path} is a {have.model_type} model but "
                         f"model.hf={mc.hf}; set model.hf={have.model_type}")
    want = hf_config(mc)
    diff = [f"{key}: {getattr(have, key, None)} there, {getattr(want, key, None)} from "
            f"model.{field}" for key, field in _FIELD.items()
            if getattr(have, key, None) != getattr(want, key, None)]
    theta = (have.rope_parameters or {}).get("rope_theta")
    if theta != mc.rope_theta:
        diff.append(f"rope_theta: {theta} there, {mc.rope_theta} from model.rope_theta")
    if diff:
        raise ValueError(f"model.pretrained={path} differs from the model config: "
                         f"{'; '.join(diff)}; set the model options to the directory's shape")


def build_model(mc: ModelConfig, seed: int):
    """The transformers causal LM of ``mc`` in fp32, in training mode, without KV cache:
    ``mc.pretrained``'s weights, or a fresh init that depends only on ``seed`` (the global
    RNG is left as it was)."""
    from transformers import AutoModelForCausalLM

    if mc.pretrained is not None:
        check_pretrained(mc)
        model = AutoModelForCausalLM.from_pretrained(mc.pretrained, local_files_only=True,
                                                     dtype=torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(hf_config(mc), dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


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


# ---- the command: python -m usp.models.export RUN_DIR_OR_STEP_DIR OUT_DIR ---------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Export a usp checkpoint of a Hugging Face model as a directory from_pretrained loads.")
    ap.add_argument("checkpoint", help="run_dir (its newest checkpoint) or run_dir/checkpoints/step_K")
    ap.add_argument("out_dir", help="directory to write (config.json + model.safetensors)")
    ap.add_argument("--config", default=None,
                    help="directory with the model's config.json (default: run_dir/hf_config)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="cast the weights (default: as stored)")
    args = ap.parse_args(argv)
    try:
        model = export_checkpoint(args.checkpoint, args.out_dir, config=args.config,
                                  dtype=DTYPES.get(args.dtype))
    except ValueError as e:
        print(f"usp.models.export: {e}", file=sys.stderr)
        return 2
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {type(model).__name__} ({n} parameters) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
