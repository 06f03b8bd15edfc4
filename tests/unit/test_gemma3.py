"""Gemma 3 4B-27B checkpoints (``gemma3``: ``Gemma3ForConditionalGeneration``, the text model
under ``text_config`` beside a SigLIP vision tower and its projector) train their text model
as the built-in Gemma 3 (usp/models/gemma3): its logits are transformers' text logits, with the
checkpoint's RoPE (test_pretrained.py) and a raised one on both layer types; the text model's
tensors load under either layout transformers 5.25 loads, the vision tower's are ignored; the
export writes a gemma3_text model (Gemma3ForCausalLM) with the run's RoPE and length and says
the vision tower is not carried over; model.hf=gemma3 is refused by name."""

import functools
import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from usp.attention import local_attention
from usp.config import ModelConfig, RecallData
from usp.config.model import CHECKPOINT_SHAPE
from usp.models.export import export_checkpoint
from usp.models.families import builtin_model, check_model
from usp.models.hf_model import check_pretrained
from usp.models.pretrained import check_checkpoint, load_state, pretrained_config
from usp.models.run_records import save_data_record, save_model_config
from usp.models.shard_load import load_shards

from _pretrained import GEMMA_ROPE, hf_logits, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
LOCAL = functools.partial(local_attention, causal=True)
# both layer types' bases raised (the full layers keep their linear factor)
RAISED = dict(rope_theta=2e6, local_rope_theta=20000.0)
RAISED_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
               "full_attention": {**GEMMA_ROPE["full_attention"], "rope_theta": 2e6}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {k: save_checkpoint(k, root / k) for k in ("gemma3", "gemma3_text")}


def _model(mc: ModelConfig, state: dict | None = None):
    model = builtin_model(mc, LOCAL)
    model.load_state_dict(load_state(mc) if state is None else state)
    return model.eval()


def _logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_text_model_is_read_and_its_logits_with_a_raised_rope_are_transformers(ckpts):
    """The text config's shape, windows, RoPE per layer type and scale; the embeddings untied
    as the outer config says (its text_config says tied); the vision tower's tensors are in the
    checkpoint and no parameter's. Both bases raised: transformers' text logits of the
    Gemma3ForConditionalGeneration (input_ids only) with the same rope_parameters."""
    from safetensors import safe_open

    mc = pretrained_config(ckpts["gemma3"])
    text = pretrained_config(ckpts["gemma3_text"])
    assert (mc.arch, mc.tie_embeddings, text.tie_embeddings) == ("gemma3", False, True)
    assert {k: getattr(mc, k) for k in CHECKPOINT_SHAPE if k not in ("arch", "tie_embeddings")
            } == {k: getattr(text, k) for k in CHECKPOINT_SHAPE
                  if k not in ("arch", "tie_embeddings")}
    assert (mc.rope_theta, mc.rope_scaling, mc.local_rope_theta) == (
        200000.0, {"rope_type": "linear", "factor": 8.0}, 5000.0)
    check_checkpoint(mc)  # the vision tower's tensors are not "left over"
    with safe_open(str(ckpts["gemma3"] / "model.safetensors"), framework="pt") as st:
        stored = list(st.keys())
    assert any(k.startswith("vision_tower.") for k in stored)
    assert "language_model.lm_head.weight" in stored
    assert sorted(load_state(mc)) == sorted(builtin_model(mc, LOCAL).state_dict())
    raised = pretrained_config(ckpts["gemma3"], **RAISED)
    got = _logits(_model(raised))
    assert _rel(got, hf_logits(ckpts["gemma3"], TOKENS, RAISED_ROPE)) < 1e-5
    assert _rel(got, hf_logits(ckpts["gemma3"], TOKENS)) > 1e-3  # the new bases matter


def _relabelled(ckpt: Path, out: Path, rename) -> Path:
    """``ckpt`` with every tensor stored under ``rename(name)`` (None: left out)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    stored = load_file(ckpt / "model.safetensors")
    save_file({rename(k): v for k, v in stored.items() if rename(k) is not None},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


def _in_memory_names(name: str) -> str:
    """transformers 5.25's model's own names for a gemma3 tensor, which it loads too."""
    return name.replace("language_model.model.", "model.language_model.").replace(
        "language_model.lm_head.", "lm_head.")


def test_the_layout_of_transformers_own_names_loads_the_same_tensors(ckpts, tmp_path):
    """``model.language_model.layers.i...`` and ``lm_head.weight`` (transformers 5.25 loads both
    layouts, its llava key mapping): the same state from load_state and from each rank's rows
    (load_shards, in one process); a text tensor in neither layout is missing, named as
    save_pretrained writes it."""
    want = load_state(pretrained_config(ckpts["gemma3"]))
    other = _relabelled(ckpts["gemma3"], tmp_path / "other", _in_memory_names)
    mc = pretrained_config(other)
    check_checkpoint(mc)
    got = load_state(mc)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    with torch.device("meta"):
        model = builtin_model(mc, LOCAL)
    load_shards(model, mc, "cpu")
    assert all(torch.equal(p, want[k]) for k, p in model.named_parameters())
    lacking = _relabelled(ckpts["gemma3"], tmp_path / "lacking",
                          lambda k: None if ".layers.1.self_attn.k_norm" in k else k)
    with pytest.raises(ValueError, match=r"language_model.model.layers.1.self_attn.k_norm.weight "
                                         r"missing; restore the checkpoint"):
        check_checkpoint(pretrained_config(lacking))


def test_model_hf_gemma3_is_refused_by_name(ckpts):
    """transformers' class of gemma3 is the whole model: model.hf=gemma3 is refused with and
    without the checkpoint, and model.hf=gemma3_text on a gemma3 checkpoint (read for its
    options, or for the model of a stated shape), each naming the built-in path and
    model.hf=gemma3_text for a text checkpoint."""
    fix = (r"train the text model on the built-in model \(model=pretrained model.pretrained=DIR "
           r"without model.hf; it exports as gemma3_text\), or model.hf=gemma3_text from a "
           r"gemma3_text checkpoint")
    with pytest.raises(ValueError, match=r"^model.hf=gemma3: transformers' class of gemma3 is "
                                         r"the whole model, its text model beside a SigLIP "
                                         r"vision tower and its projector.*" + fix):
        check_model(ModelConfig(hf="gemma3", qk_norm=True))
    for hf in ("gemma3", "gemma3_text"):
        with pytest.raises(ValueError, match=f"is a gemma3 checkpoint, with model.hf={hf}: "
                                             ".*" + fix):
            pretrained_config(ckpts["gemma3"], hf=hf)
    # a stated shape reads no checkpoint until the transformers model is built
    stated = replace(pretrained_config(ckpts["gemma3_text"], hf="gemma3_text"),
                     pretrained=str(ckpts["gemma3"]))
    with pytest.raises(ValueError, match="is a gemma3 checkpoint, with model.hf=gemma3_text: "
                                         ".*" + fix):
        check_pretrained(stated)


def _usp_run(model, mc: ModelConfig, run_dir: Path, seq_len: int) -> Path:
    """``run_dir`` as a usp-train run of ``mc`` leaves it for the export, written in one
    process: its model config and data records, and checkpoint step_000001 holding the model's
    DCP shards beside an extra.pt without a format key (the layout before manifests, which the
    export reads unverified: save_checkpoint's manifest takes a process group)."""
    step = run_dir / "checkpoints" / "step_000001"
    with warnings.catch_warnings():  # DCP warns that one process is assumed: it is meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    torch.save({"step": 1}, step / "extra.pt")
    save_model_config(mc, run_dir)
    save_data_record(RecallData(seq_len=seq_len, batch_per_dp_rank=1), run_dir, None)
    return run_dir


@pytest.mark.parametrize("kind", ["gemma3", "gemma3_text"])
def test_the_export_is_a_gemma3_text_model_with_the_runs_rope_and_logits(ckpts, kind,
                                                                         tmp_path):
    """A run from either checkpoint, both bases raised and its weights moved off the
    checkpoint's: usp-export writes a Gemma3ForCausalLM (gemma3_text) with the run's
    rope_parameters per layer type, its trained length, layer_types and scale, which transformers
    reloads with the run's logits; from gemma3, the vision tower is said not carried over."""
    from transformers import AutoConfig, AutoModelForCausalLM

    mc = pretrained_config(ckpts[kind], **RAISED)
    model = _model(mc)
    with torch.no_grad():  # the run's own weights, not the checkpoint's
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    done = export_checkpoint(_usp_run(model, mc, tmp_path / "run", 32), tmp_path / "out")
    assert type(done.model).__name__ == "Gemma3ForCausalLM"
    hc = AutoConfig.from_pretrained(tmp_path / "out")
    assert (hc.model_type, hc.rope_parameters, hc.max_position_embeddings) == (
        "gemma3_text", RAISED_ROPE, 32)
    assert (hc.query_pre_attn_scalar, hc.sliding_window, hc.tie_word_embeddings) == (
        20, 6, mc.tie_embeddings)
    assert hc.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(hf(input_ids=TOKENS).logits, _logits(model)) < 1e-5
    dropped = [n for n in done.summary() if "not carried over" in n]
    if kind == "gemma3":
        assert dropped == [f"model.arch=gemma3: the export is its text model alone "
                           f"(gemma3_text); a SigLIP vision tower and its projector of "
                           f"model.pretrained={ckpts['gemma3']} are not carried over (usp "
                           "neither loads nor trains them): take them from that checkpoint"]
    else:
        assert dropped == []


# google/gemma-3-12b-pt's config.json as released, as public copies of it give it (its
# text_config states only what differs from Gemma3TextConfig's defaults); the vision_config is
# SigLIP's, unread by usp
GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                    "num_attention_heads": 16, "num_hidden_layers": 48,
                    "num_key_value_heads": 8, "sliding_window": 1024,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}


def test_the_12b_recipe_states_the_shape_read_from_the_released_config(tmp_path):
    """recipes/gemma3_12b_extend_128k_h100x16.yaml states every shape key as usp reads it from
    Gemma-3-12B's config.json (transformers' defaults where the file is silent: vocab 262208,
    head_dim 256, query_pre_attn_scalar 256, 5 local : 1 global), so the run accepts the
    released checkpoint; its RoPE differs from the checkpoint's on the global layers only."""
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_12B))
    mc = pretrained_config(tmp_path)
    recipe = yaml.safe_load((ROOT / "recipes" / "gemma3_12b_extend_128k_h100x16.yaml")
                            .read_text())["model"]
    assert {k: recipe[k] for k in CHECKPOINT_SHAPE} == {k: getattr(mc, k) for k in CHECKPOINT_SHAPE}
    assert (mc.vocab_size, mc.head_dim, mc.query_pre_attn_scalar, mc.tie_embeddings) == (
        262208, 256, 256, True)
    assert mc.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 8
    assert (mc.rope_theta, mc.rope_scaling, mc.local_rope_theta) == (
        1e6, {"rope_type": "linear", "factor": 8.0}, 10000.0)
    assert recipe["local_rope_theta"] == mc.local_rope_theta
    assert (recipe["rope_theta"], recipe["rope_scaling"]) != (mc.rope_theta, mc.rope_scaling)
