"""model.pretrained: a transformers checkpoint as the built-in model (usp.models.pretrained,
usp.models.families): its config read, its weights loaded, and the logits transformers'."""

import functools
from dataclasses import replace

import pytest
import torch

from usp.attention import local_attention
from usp.config import ModelConfig
from usp.models.families import BUILTIN, builtin_model
from usp.models.pretrained import check_checkpoint, fill_model, load_state, pretrained_config

from _pretrained import HF_ONLY, KINDS, hf_logits, save_checkpoint

TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {k: save_checkpoint(k, root / k) for k in KINDS}


def builtin_logits(mc: ModelConfig, tokens=TOKENS):
    model = builtin_model(mc, functools.partial(local_attention, causal=True))
    model.load_state_dict(load_state(mc))
    with torch.no_grad():
        return model.eval()(tokens, torch.arange(tokens.shape[1]))


def close(a, b, rel=1e-5):
    return float((a - b).abs().max() / b.abs().max()) < rel


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_logits_equal_transformers(ckpts, kind):
    """The checkpoint's own shape and RoPE (Llama: llama3 scaling and head_dim 32; Qwen2: q/k/v
    biases, tied, windowed layers 1-2; Mistral: a window of 5; Gemma 3: its norms around each
    part, GeGLU, scaled embeddings, attention scale and a RoPE per layer type; gpt-oss: sinks,
    q/k/v/o biases, its experts, YaRN: more in test_gpt_oss.py) give
    transformers' logits. Every tensor moves over unchanged: a q/k permutation (Meta's
    original layout) would break this."""
    mc = pretrained_config(ckpts[kind])
    assert mc.arch == kind
    check_checkpoint(mc)
    assert close(builtin_logits(mc), hf_logits(ckpts[kind], TOKENS))


def test_the_adapters_move_q_and_k_unpermuted(ckpts):
    """q_proj / k_proj load as they are stored (both sides rotate half)."""
    from safetensors.torch import load_file

    mc = pretrained_config(ckpts["llama"])
    stored = load_file(ckpts["llama"] / "model.safetensors")
    state = load_state(mc)
    for i in range(mc.n_layers):
        for p, hf in (("wq", "q_proj"), ("wk", "k_proj")):
            assert torch.equal(state[f"layers.{i}.attention.{p}.weight"],
                               stored[f"model.layers.{i}.self_attn.{hf}.weight"])


@pytest.mark.parametrize("rope", [
    {"rope_theta": 8e6, "rope_type": "default"},
    {"rope_theta": 500000.0, "rope_type": "linear", "factor": 4.0},
    {"rope_theta": 2e6, "rope_type": "yarn", "factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
])
def test_changed_rope_equals_transformers_with_the_same_config(ckpts, rope):
    """A raised rope_theta and each rope_type on the checkpoint's weights: transformers' logits
    with the same rope_parameters (YaRN's attention factor included)."""
    theta = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    mc = pretrained_config(ckpts["llama"], rope_theta=theta, rope_scaling=scaling)
    assert close(builtin_logits(mc), hf_logits(ckpts["llama"], TOKENS, rope))


def test_rope_scaling_auto_is_the_checkpoints_and_none_removes_it(ckpts):
    assert pretrained_config(ckpts["llama"]).rope_scaling["rope_type"] == "llama3"
    assert pretrained_config(ckpts["llama"], rope_scaling="none").rope_scaling is None
    assert pretrained_config(ckpts["llama"], rope_scaling=None).rope_scaling is None
    assert pretrained_config(ckpts["qwen2"]).rope_scaling is None


def test_a_set_shape_key_must_agree_with_the_checkpoint(ckpts):
    assert pretrained_config(ckpts["qwen2"], dim=64, n_heads=4).dim == 64  # agrees: kept
    with pytest.raises(ValueError, match=r"dim: 96 set, 64 in the checkpoint.*"
                                         r"n_kv_heads: 4 set, 2 in the checkpoint"):
        pretrained_config(ckpts["qwen2"], dim=96, n_kv_heads=4)


def test_auto_without_a_checkpoint_is_refused():
    base = {**vars(ModelConfig()), "dim": "auto"}
    with pytest.raises(ValueError, match=r"model.dim=auto is read from a checkpoint"):
        fill_model(base)
    assert fill_model({**vars(ModelConfig()), "rope_scaling": "auto"})["rope_scaling"] is None


def test_bad_checkpoints_are_refused_with_the_fix(ckpts, tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        pretrained_config(tmp_path)
    (tmp_path / "config.json").write_text((ckpts["llama"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"has no weights \(\*.safetensors\)"):
        check_checkpoint(pretrained_config(tmp_path))
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((ckpts["llama"] / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model.safetensors is damaged"):
        check_checkpoint(pretrained_config(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "olmo3", "vocab_size": 10}')
    with pytest.raises(ValueError) as err:
        pretrained_config(tmp_path)
    said = str(err.value)  # the path once, and no pointer to model.hf, which refuses it too
    assert said.startswith(f"model.pretrained={tmp_path} is a 'olmo3' model; usp maps "
                           + ", ".join(BUILTIN)) and said.count("model.pretrained=") == 1
    assert ("model.hf trains those" + "".join(f" and {k}" for k in HF_ONLY)
            + " as transformers' classes") in said
    assert "usp-train cannot train it" in said and "usp.models.hf.patch" in said


def test_what_a_qwen3_checkpoint_holds_is_read_and_its_o_proj_bias_refused(ckpts, tmp_path):
    """A Qwen3's q/k norms are read as model.qk_norm and load (one [head_dim] weight each per
    layer, none on the other families); its attention_bias (on o_proj too) is refused by name."""
    import json
    import shutil

    mc = pretrained_config(ckpts["qwen3"])
    assert (mc.qk_norm, mc.qkv_bias, mc.head_dim) == (True, False, 24)
    assert (mc.sliding_window, mc.layer_types[2]) == (6, "sliding_attention")
    state = load_state(mc)
    assert state["layers.1.attention.k_norm.weight"].shape == (24,)
    assert replace(mc, pretrained=None).num_params() == sum(t.numel() for t in state.values())
    assert not pretrained_config(ckpts["llama"]).qk_norm
    shutil.copytree(ckpts["qwen3"], tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "attention_bias": True}))
    with pytest.raises(ValueError, match=r"attention_bias=true: the built-in model has no "
                                         r"o_proj bias.*model.hf=qwen3"):
        pretrained_config(tmp_path / "ckpt")


def test_a_config_missing_a_shape_key_is_refused_naming_it(ckpts, tmp_path):
    """transformers would fill num_attention_heads with 32 and the weights would then be
    refused by their shape; the refusal names the key instead, on both model paths."""
    import json
    import shutil

    from usp.models.hf_model import check_pretrained

    shutil.copytree(ckpts["qwen2"], tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_attention_heads"}))
    said = r"config.json has no num_attention_heads; transformers would fill it with its " \
           r"default \(num_attention_heads=32\)"
    with pytest.raises(ValueError, match=said):
        pretrained_config(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=said):
        check_pretrained(ModelConfig(hf="qwen2", pretrained=str(tmp_path / "ckpt")))


def test_the_data_vocabulary_must_fit_the_embedding(ckpts):
    base = {**vars(pretrained_config(ckpts["mistral"])), "vocab_size": "auto"}
    assert fill_model(base, data_vocab=100)["vocab_size"] == 128
    with pytest.raises(ValueError, match=r"vocabulary \(200 ids\) is larger than the embedding"
                                         r".*\(128 rows\)"):
        fill_model(base, data_vocab=200)


def test_a_qwen2_without_windows_keeps_its_biases(tmp_path):
    """Export and import key on the architecture, not the windows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from _pretrained import SHAPE

    Qwen2ForCausalLM(Qwen2Config(**SHAPE)).save_pretrained(tmp_path)
    mc = pretrained_config(tmp_path)
    assert (mc.arch, mc.qkv_bias, mc.sliding_window, mc.layer_types) == ("qwen2", True, None, None)
    assert "layers.0.attention.wq.bias" in load_state(mc)
    assert replace(mc, pretrained=None).num_params() == sum(
        t.numel() for t in load_state(mc).values())


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from usp import cli

    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        return cli.to_config(compose("train", overrides=list(overrides)))


def test_model_pretrained_option_fills_its_auto_keys_from_config_json(ckpts):
    """usp-train model=pretrained model.pretrained=DIR: the shape from DIR/config.json; a
    raised rope_theta is taken; a contradicting shape key is refused with both values."""
    d = ckpts["qwen2"]
    cfg = _compose("model=pretrained", f"model.pretrained={d}", "model.loss_chunk=8")
    assert cfg.model == replace(pretrained_config(d), loss_chunk=8)
    raised = _compose("model=pretrained", f"model.pretrained={d}", "model.rope_theta=8e6")
    assert raised.model.rope_theta == 8e6
    with pytest.raises(ValueError, match=r"n_layers: 4 set, 3 in the checkpoint"):
        _compose("model=pretrained", f"model.pretrained={d}", "model.n_layers=4")
    llama = _compose("model=pretrained", f"model.pretrained={ckpts['llama']}",
                     "model.rope_scaling=none")
    assert llama.model.rope_scaling is None and llama.model.head_dim == 32


def test_a_run_records_the_checkpoints_tokenizer_and_the_datas_eos(ckpts, tmp_path):
    """Without a data tokenizer the export takes the pretrained directory's tokenizer files
    (not its weights); the data's EOS id is recorded for the export's config."""
    import json
    import shutil

    from _export_runs import run_cfg, tiny_tokenizer

    from usp.models.run_records import load_data_record
    from usp.train.build import record_for_export

    d = tmp_path / "ckpt"
    shutil.copytree(ckpts["llama"], d)
    tiny_tokenizer(d)
    cfg = run_cfg(tmp_path / "run", model=pretrained_config(d))
    record_for_export(cfg, tmp_path / "run")
    copied = sorted(p.name for p in (tmp_path / "run" / "tokenizer").iterdir())
    assert "tokenizer_config.json" in copied and "model.safetensors" not in copied
    assert {k: load_data_record(tmp_path / "run")[k] for k in ("seq_len", "eos_token_id")} == {
        "seq_len": 64, "eos_token_id": None}

    from _export_runs import corpus, memmap

    corpus(tmp_path / "data")
    meta = tmp_path / "data.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "eos_id": 2}))
    record_for_export(run_cfg(tmp_path / "bytes", data=memmap(tmp_path / "data")),
                      tmp_path / "bytes")
    assert load_data_record(tmp_path / "bytes")["eos_token_id"] == 2


def test_start_notes_report_the_rope_change_and_warn_when_nothing_is_extended(ckpts):
    from usp.models.pretrained import start_notes

    raised = start_notes(pretrained_config(ckpts["llama"], rope_theta=8e6), seq_len=64)
    assert "rope_theta 500000 -> 8000000" in raised and not any("warning" in n for n in raised)
    short = start_notes(pretrained_config(ckpts["llama"]), seq_len=16)  # original: 16
    assert [n for n in short if n.startswith("warning")] == [
        "warning: model.rope_scaling.original_max_position_embeddings=16 >= data.seq_len=16: "
        "this run extends nothing beyond the original context; raise data.seq_len or lower "
        "the scaling"]


def test_a_stated_shape_meets_the_data_vocabulary_rule_of_the_checkpoint(ckpts, tmp_path):
    """A recipe's stated shape (no auto key) is checked against the data in preflight, with
    the checkpoint's fix, not model.vocab_size=auto's."""
    from _export_runs import corpus, memmap

    from usp.data.dataset import check_vocab

    corpus(tmp_path / "data")  # ~90 ids
    mc = replace(pretrained_config(ckpts["mistral"]), vocab_size=64)
    with pytest.raises(ValueError, match=r"> the embedding of model.pretrained=.* \(64 rows\).*"
                                         r"checkpoint's tokenizer"):
        check_vocab(memmap(tmp_path / "data"), mc)


def test_usp_eval_scores_the_checkpoints_own_weights(ckpts):
    """``usp-eval`` of the built-in model of ``model.pretrained`` (no ``eval.run_dir``) builds
    it where training does (``usp.models.routed.routed_model``) and holds the checkpoint's
    tensors, not a fresh init."""
    from types import SimpleNamespace

    from usp.eval.runner import eval_model

    mc = pretrained_config(ckpts["qwen2"])
    job = SimpleNamespace(cfg=SimpleNamespace(model=mc, trainer=SimpleNamespace(seed=0)),
                          checkpoint=None)
    run = SimpleNamespace(attention_options=dict, dtype="fp32")
    model, _ = eval_model(job, run, None, torch.device("cpu"))
    want, got = load_state(mc), dict(model.named_parameters())
    assert sorted(want) == sorted(got)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
