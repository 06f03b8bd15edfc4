"""Gemma 3 text on the built-in model (usp/models/gemma3_text): a RoPE per layer type that a
run may change (model.rope_theta / rope_scaling on the full layers, model.local_rope_theta on
the sliding ones), the memory features, model.hf=gemma3_text with and without a checkpoint,
and what is refused by name. The checkpoint's own logits: test_pretrained.py."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from usp.config import ModelConfig
from usp.models.families import builtin_model, check_model
from usp.models.hf_model import build_model, hf_config
from usp.models.pretrained import load_state, pretrained_config, start_notes

from _pretrained import GEMMA_ROPE, LOCAL, REFERENCE, hf_logits, save_checkpoint

TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint("gemma3_text", tmp_path_factory.mktemp("gemma") / "gemma3_text")


def _logits(mc: ModelConfig, tokens=TOKENS) -> torch.Tensor:
    model = builtin_model(mc, LOCAL)
    model.load_state_dict(load_state(mc))
    with torch.no_grad():
        return model.eval()(tokens, torch.arange(tokens.shape[1]))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_checkpoint_is_read_with_a_rope_per_layer_type(ckpt):
    mc = pretrained_config(ckpt)
    assert (mc.arch, mc.qk_norm, mc.query_pre_attn_scalar, mc.tie_embeddings) == (
        "gemma3_text", True, 20, True)
    assert (mc.rope_theta, mc.rope_scaling, mc.local_rope_theta) == (
        200000.0, {"rope_type": "linear", "factor": 8.0}, 5000.0)
    assert (mc.sliding_window, mc.layer_types) == (6, ["sliding_attention", "full_attention",
                                                       "sliding_attention"])
    assert [mc.layer_rope(i) for i in range(3)] == [
        (5000.0, None), (200000.0, {"rope_type": "linear", "factor": 8.0}), (5000.0, None)]
    assert "layers.1.post_ffn_norm.weight" in load_state(mc)


def test_a_raised_rope_on_both_layer_types_equals_transformers_with_the_same_config(ckpt):
    """model.rope_theta changes the full layers (their linear factor kept), model.local_rope_theta
    the sliding ones: transformers' logits with those rope_parameters, not the checkpoint's;
    the start notes name each change with its layer type."""
    mc = pretrained_config(ckpt, rope_theta=2e6, local_rope_theta=20000.0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            "full_attention": {**GEMMA_ROPE["full_attention"], "rope_theta": 2e6}}
    got = _logits(mc)
    assert _rel(got, hf_logits(ckpt, TOKENS, rope)) < 1e-5
    assert _rel(got, hf_logits(ckpt, TOKENS)) > 1e-3  # the new bases matter
    notes = start_notes(mc, seq_len=64)
    assert "rope_theta 200000 -> 2000000 (full_attention layers)" in notes
    assert "local_rope_theta 5000 -> 20000 (sliding_attention layers)" in notes


def _random_gemma(**kw):
    """A Gemma of fp64 random weights (norms included: zero would hide a swapped one), with
    windows, a RoPE per layer type and its own attention scale."""
    mc = ModelConfig(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64,
                     head_dim=8, qk_norm=True, query_pre_attn_scalar=12, sliding_window=5,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     local_rope_theta=100.0, rope_theta=1000.0, arch="gemma3_text",
                     **{k: v for k, v in kw.items() if k in ("loss_chunk", "mlp_tiles")})
    model = builtin_model(mc, REFERENCE, **{k: v for k, v in kw.items()
                                        if k not in ("loss_chunk", "mlp_tiles")})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.double()


def _loss_and_grads(model):
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 96, (2, 20), generator=gen)
    labels = torch.randint(0, 96, (2, 20), generator=gen)
    loss, _ = model(tokens, torch.arange(20), labels=labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kw", [
    dict(loss_chunk=7, mlp_tiles=3),
    dict(checkpoint_activations=True, checkpoint_part="block"),
    dict(checkpoint_activations=True, checkpoint_part="attention", mlp_tiles=2),
    dict(checkpoint_activations=True, checkpoint_part="mlp", loss_chunk=16, checkpoint_every=2),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items() if k != "checkpoint_activations"))
def test_the_memory_features_change_no_loss_or_gradient(kw):
    """The chunked LM head, the tiled GeGLU and each part activation checkpoints recompute
    (the post norms inside it) give the plain model's loss and gradients in fp64."""
    want_loss, want = _loss_and_grads(_random_gemma())
    got_loss, got = _loss_and_grads(_random_gemma(**kw))
    assert got_loss == pytest.approx(want_loss, rel=1e-12)
    for name, g in want.items():
        assert _rel(got[name], g) < 1e-10, name


def test_model_hf_gemma3_text_with_and_without_the_checkpoint(ckpt):
    """From the checkpoint transformers' class computes the built-in model's logits; without
    it, hf_config writes the Gemma3TextConfig of the same function (the checkpoint's weights
    in a model of that config give the same logits)."""
    from transformers import AutoModelForCausalLM

    want = _logits(pretrained_config(ckpt))
    hf_mc = pretrained_config(ckpt, hf="gemma3_text")
    check_model(hf_mc)
    with torch.no_grad():
        assert _rel(build_model(hf_mc, 0).eval()(input_ids=TOKENS).logits, want) < 1e-5
    fresh = replace(hf_mc, pretrained=None)
    check_model(fresh)
    hc = hf_config(fresh)
    assert (hc.query_pre_attn_scalar, hc.sliding_window, hc.rope_parameters) == (
        20, 6, GEMMA_ROPE)
    model = AutoModelForCausalLM.from_config(hc, dtype=torch.float32)
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(ckpt).state_dict())
    with torch.no_grad():
        assert _rel(model.eval()(input_ids=TOKENS).logits, want) < 1e-5


def _edited(ckpt, tmp_path, **keys):
    shutil.copytree(ckpt, tmp_path / "edited")
    path = tmp_path / "edited" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))
    return tmp_path / "edited"


def test_capped_final_logits_are_refused_by_the_built_in_model_not_by_model_hf(ckpt, tmp_path):
    """transformers applies final_logit_softcapping to the logits; the built-in model does not,
    so it refuses it naming the key and model.hf, which computes it. attn_logit_softcapping
    transformers stores but applies nowhere: read as nothing, refused nowhere."""
    capped = _edited(ckpt, tmp_path, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match=r"model.pretrained=.*: final_logit_softcapping=30.0: "
                                         r"the built-in Gemma 3 .*model.hf=gemma3_text"):
        pretrained_config(capped)
    check_model(pretrained_config(capped, hf="gemma3_text"))
    uncapped = _edited(ckpt, tmp_path / "u", attn_logit_softcapping=50.0)
    assert _rel(_logits(pretrained_config(uncapped)), hf_logits(uncapped, TOKENS)) < 1e-5


@pytest.mark.parametrize("keys,needle", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "sliding_attention"]),
     "layer_types has chunked_attention: usp computes full_attention and sliding_attention"),
])
def test_what_neither_model_computes_is_refused_by_name(ckpt, tmp_path, keys, needle):
    path = _edited(ckpt, tmp_path, **keys)
    for hf in (None, "gemma3_text"):
        with pytest.raises(ValueError, match=needle):
            pretrained_config(path, hf=hf)


def test_the_sliding_layers_base_and_the_scale_are_gemmas_only(ckpt, tmp_path):
    """model.local_rope_theta and model.query_pre_attn_scalar have no place in another family's
    config: refused on a Llama checkpoint, on a built-in model without model.arch (which exports
    as a family of the shared decoder) and under another model.hf."""
    llama = save_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"model.local_rope_theta=20000.0 but model.arch=llama "
                                         r"has no such setting.*\(gemma3_text"):
        pretrained_config(llama, local_rope_theta=20000.0)
    with pytest.raises(ValueError, match=r"model.query_pre_attn_scalar=20 but a built-in model "
                                         r"without model.arch \(exported as qwen3\)"):
        check_model(ModelConfig(qk_norm=True, query_pre_attn_scalar=20))
    with pytest.raises(ValueError, match=r"model.local_rope_theta=100.0 but model.hf=qwen2"):
        check_model(ModelConfig(hf="qwen2", local_rope_theta=100.0))
