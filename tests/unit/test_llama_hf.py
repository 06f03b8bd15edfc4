"""The built-in model as its family's transformers model (``usp.models.families``), in one
process: after a few optimizer steps the mapped model gives the same logits and loss, with tied
or untied embeddings, windows on every layer or some (Mistral, Qwen2 with zero q/k/v biases),
q/k norms (Qwen3), and per-document RoPE equals each document alone. Exports of real runs:
``distributed/test_export_ranks.py``."""

import functools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from usp.attention import local_attention
from usp.models.decoder import Transformer
from usp.models.families import (BUILTIN, builtin_model, check_model, hf_equivalent, hf_names,
                                 zero_filled)
from usp.models.hf_model import hf_config

from _export_runs import MODEL

pytest.importorskip("transformers")
L = 48


def _trained(mc) -> Transformer:
    """The built-in model (its family's class) after three AdamW steps on random tokens: every
    weight off its init (the norms' too)."""
    model = builtin_model(mc, functools.partial(local_attention, causal=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, mc.vocab_size, (2, L + 1), generator=gen)
        loss, _ = model(tokens[:, :-1], torch.arange(L), labels=tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _as_hf(model: Transformer):
    """The transformers model of ``model``'s config, holding its weights under the mapped
    names (and the zero-filled ones): nothing left unfilled, nothing unplaced."""
    from transformers import AutoModelForCausalLM

    mc = model.cfg
    hf = AutoModelForCausalLM.from_config(hf_config(hf_equivalent(mc)), dtype=torch.float32)
    mine = model.state_dict()
    state = {h: mine[u] for u, h in hf_names(mc).items()}
    state.update({k: torch.zeros_like(hf.state_dict()[k]) for k in zero_filled(mc)})
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if mc.tie_embeddings else [])
    if mc.tie_embeddings:  # the missing head is the embedding itself
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    return hf.eval()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("kw,arch", [
    (dict(tie_embeddings=False), "LlamaForCausalLM"),
    (dict(), "LlamaForCausalLM"),  # tied
    (dict(sliding_window=8, full_attention_every=1), "LlamaForCausalLM"),  # every layer full
    (dict(sliding_window=8), "MistralForCausalLM"),  # every layer windowed
    (dict(sliding_window=8, full_attention_every=3), "MistralForCausalLM"),  # 2 layers < 3
    (dict(sliding_window=8, full_attention_every=2, tie_embeddings=False), "Qwen2ForCausalLM"),
    (dict(qk_norm=True, sliding_window=8, full_attention_every=2), "Qwen3ForCausalLM"),
])
def test_builtin_model_maps_to_the_architecture_that_computes_it(kw, arch):
    model = _trained(replace(MODEL, **kw))
    hf = _as_hf(model)
    assert type(hf).__name__ == arch
    tokens = torch.randint(0, MODEL.vocab_size, (2, L + 1), generator=torch.Generator().manual_seed(2))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        want = model(ids, torch.arange(L))
        want_loss, _ = model(ids, torch.arange(L), labels=labels)
        got = hf(input_ids=ids).logits
    got_loss = F.cross_entropy(got.flatten(0, 1), labels.flatten(), reduction="sum")
    assert _rel(got, want) <= 1e-4
    assert abs(got_loss - want_loss).item() <= 1e-4 * want_loss.item()
    mc = model.cfg
    if any(mc.layer_window(i) for i in range(mc.n_layers)):  # a window that matters: 8 < L
        unwindowed = Transformer(replace(mc, sliding_window=None, full_attention_every=0),
                                 functools.partial(local_attention, causal=True))
        unwindowed.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert _rel(unwindowed.eval()(ids, torch.arange(L)), want) > 1e-3


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # factor 1.14
], ids=lambda s: s["rope_type"])
def test_rope_scaling_gives_transformers_logits_for_the_same_config(scaling):
    """Scaled RoPE at positions past the original context: transformers' model of the same
    config (its rope_parameters) computes the built-in model's logits."""
    model = _trained(replace(MODEL, rope_scaling=scaling))
    hf = _as_hf(model)
    assert hf.config.rope_parameters == {"rope_theta": MODEL.rope_theta, **model.cfg.rope_scaling}
    ids = torch.randint(0, MODEL.vocab_size, (2, L), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(L) + 200  # beyond the original 64 (contiguous: transformers reads
    # a jump in position_ids as the start of a packed document)
    plain = Transformer(MODEL, functools.partial(local_attention, causal=True)).eval()
    plain.load_state_dict(model.state_dict())  # the same weights, plain RoPE
    with torch.no_grad():
        want = model(ids, positions)
        got = hf(input_ids=ids, position_ids=positions[None].expand(2, L)).logits
        unscaled = plain(ids, positions)
    assert _rel(got, want) <= 1e-5
    assert _rel(unscaled, want) > 1e-3  # the scaling matters at these positions


def test_per_document_rope_is_each_document_alone_from_position_0():
    mc = replace(MODEL, rope="per_document", sliding_window=8, full_attention_every=2)
    model = _trained(mc)
    hf = _as_hf(model)
    bounds = [(0, 20), (20, 31), (31, L)]  # three documents packed in one row
    ids = torch.randint(0, mc.vocab_size, (1, L), generator=torch.Generator().manual_seed(3))
    segment_ids = torch.cat([torch.full((1, e - s), d) for d, (s, e) in enumerate(bounds)], 1)
    positions = torch.cat([torch.arange(e - s) for s, e in bounds])[None]  # [1, L]
    with torch.no_grad():
        packed = model(ids, positions, segment_ids)
        for s, e in bounds:
            assert _rel(hf(input_ids=ids[:, s:e]).logits, packed[:, s:e]) <= 1e-4


def test_hf_equivalent_refuses_a_transformers_model():
    with pytest.raises(ValueError, match="model.hf=llama is a transformers model already"):
        hf_equivalent(replace(MODEL, hf="llama"))


WINDOWS = {"none": dict(),  # every layer full
           "every": dict(sliding_window=8),
           "some": dict(sliding_window=8, full_attention_every=2)}  # layer 1 full
# the window settings each family cannot hold (a family without an entry fails by name)
REFUSED = {"llama": {"every", "some"}, "qwen2": set(), "mistral": {"some"}, "qwen3": set(),
           "gemma3_text": set(), "gemma3": set(), "qwen3_moe": {"some"}, "gpt_oss": set()}
# what a family states beyond the shared decoder's shape: Qwen3-MoE's experts (layer 1 dense),
# gpt-oss's (every layer), its o_proj bias and sinks
STATED = {"qwen3_moe": dict(n_experts=4, experts_per_token=2, expert_ffn_dim=16,
                            norm_topk_prob=True, sparse_layers=[0]),
          "gpt_oss": dict(n_experts=4, experts_per_token=2, expert_ffn_dim=16, swiglu_limit=7.0,
                          swiglu_alpha=1.702, o_bias=True, attention_sinks=True)}
# the architecture a run from a checkpoint of a family exports as, where it is not the family
# itself: a gemma3 checkpoint's text model alone
EXPORTED = {"gemma3": "gemma3_text"}


@pytest.mark.parametrize("arch", BUILTIN)
@pytest.mark.parametrize("windows", WINDOWS)
def test_a_run_from_a_checkpoint_exports_as_its_architecture(arch, windows, tmp_path):
    """``model.arch`` (a run from a checkpoint) is the exported architecture at every window
    setting it can hold (a gemma3 checkpoint's: its text model, gemma3_text; a Qwen3-MoE's
    experts written per expert by save_pretrained and stacked again on load): saved and
    reloaded by transformers, that ``model_type`` and the built-in model's logits. A window a Llama cannot hold, and a Mistral window on some
    layers only, are refused with the setting named."""
    from transformers import AutoModelForCausalLM

    kw = dict(arch=arch, qkv_bias=BUILTIN[arch].biases, qk_norm=BUILTIN[arch].qk_norm,
              **WINDOWS[windows], **STATED.get(arch, {}))
    if windows in REFUSED[arch]:
        with pytest.raises(ValueError, match=f"model.arch={arch}"):
            check_model(replace(MODEL, **kw))
        return
    model = _trained(replace(MODEL, **kw))
    _as_hf(model).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.model_type == EXPORTED.get(arch, arch)
    ids = torch.randint(0, MODEL.vocab_size, (2, L), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _rel(hf(input_ids=ids).logits, model(ids, torch.arange(L))) <= 1e-5


def test_layer_types_of_the_wrong_length_are_refused_before_the_architectures_windows():
    with pytest.raises(ValueError, match="has 1 entries for 2 layers"):
        replace(MODEL, arch="qwen2", qkv_bias=True, sliding_window=8,
                layer_types=["sliding_attention"])


@pytest.mark.parametrize("windows", ["none", "every"])
def test_a_built_in_model_with_biases_exports_as_qwen2_at_any_windows(windows, tmp_path):
    """q/k/v biases without ``model.arch``: the family of the windows (Llama, Mistral) has no
    biases, so the export is a Qwen2 holding them, reloaded with the built-in model's logits.
    Before, it was a Llama or Mistral config with bias weights it has no place for."""
    from transformers import AutoModelForCausalLM

    model = _trained(replace(MODEL, qkv_bias=True, **WINDOWS[windows]))
    _as_hf(model).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.model_type == "qwen2"
    assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # the trained biases
    ids = torch.randint(0, MODEL.vocab_size, (2, L), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _rel(hf(input_ids=ids).logits, model(ids, torch.arange(L))) <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_biases_on_a_run_from_a_checkpoint_without_them_are_refused(arch):
    with pytest.raises(ValueError, match=f"model.arch={arch} has no q/k/v biases"):
        check_model(replace(MODEL, arch=arch, qkv_bias=True))


@pytest.mark.parametrize("kw,needle", [
    (dict(arch="llama", qk_norm=True), r"model.arch=llama has no q/k norms \(model.qk_norm=true\)"),
    (dict(arch="qwen3"), r"model.arch=qwen3 normalises q and k per head \(model.qk_norm=false\)"),
    (dict(arch="qwen3", qk_norm=True, qkv_bias=True), "model.arch=qwen3 has no q/k/v biases"),
    (dict(qk_norm=True, qkv_bias=True), "no family holds both"),
])
def test_q_k_norms_only_on_the_family_that_has_them(kw, needle):
    with pytest.raises(ValueError, match=needle):
        check_model(replace(MODEL, **kw))


@pytest.mark.parametrize("kw,needle", [
    (dict(hf="llama", qkv_bias=True), r"model.hf=llama has no q/k/v biases \(model.qkv_bias=true\)"),
    (dict(hf="mistral", qk_norm=True), r"model.hf=mistral has no q/k norms \(model.qk_norm=true\)"),
    (dict(hf="qwen2", qk_norm=True), r"model.hf=qwen2 has no q/k norms"),
    (dict(hf="qwen3", qkv_bias=True), r"model.hf=qwen3 has no q/k/v biases"),
])
def test_model_hf_refuses_biases_or_norms_its_class_has_not(kw, needle):
    """The transformers class decides them: asked of one without, they are refused, not
    dropped (before, model.hf=llama model.qkv_bias=true built a Llama without biases)."""
    with pytest.raises(ValueError, match=needle):
        check_model(replace(MODEL, **kw))
    check_model(replace(MODEL, hf=kw["hf"]))  # the class's own shape is accepted


def test_model_hf_of_another_architecture_than_its_checkpoints_is_pointed_at_it():
    """Biases read from a checkpoint (a Qwen2's) under model.hf=llama: the fix named is the
    checkpoint's architecture, not a key the checkpoint fixes."""
    with pytest.raises(ValueError, match=r"model.hf=llama has no q/k/v biases .*checkpoint's "
                                         r"architecture"):
        check_model(replace(MODEL, hf="llama", qkv_bias=True, pretrained="/ckpt/qwen2"))
