"""usp-train with a transformers model (``model.hf``), one process: configs map and
refusals; the tiny windowed options keep recall answerable through a window that hides part
of the context; the 7-8B recipes pass preflight against their checkpoints' published
config.json and usp-plan plans them. Training on ranks: ``distributed/test_hf_train_ranks.py``."""

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import usp.cli as cli
from usp.config import ModelConfig
from usp.data.synthetic import RecallTask
from usp.models.families import check_model
from usp.models.hf_model import build_model, hf_config
from usp.data.dataset import build_dataset
from usp.run import resolve_run

from _hf_runs import small_cfg

pytest.importorskip("transformers")


def test_model_config_maps_to_the_transformers_config():
    q = hf_config(ModelConfig(hf="qwen2", sliding_window=256, full_attention_every=2,
                              n_layers=4, rope_theta=5e5, norm_eps=1e-6))
    assert type(q).__name__ == "Qwen2Config"
    assert q.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (q.sliding_window, q.rope_parameters["rope_theta"], q.rms_norm_eps) == (256, 5e5, 1e-6)
    q3 = hf_config(ModelConfig(hf="qwen3", head_dim=24, sliding_window=256, n_layers=3,
                               layer_types=["full_attention"] * 2 + ["sliding_attention"]))
    assert (type(q3).__name__, q3.head_dim, q3.attention_bias, q3.layer_types[1:]) == (
        "Qwen3Config", 24, False, ["full_attention", "sliding_attention"])
    m = hf_config(ModelConfig(hf="mistral", sliding_window=100, tie_embeddings=False))
    assert (type(m).__name__, m.sliding_window, m.tie_word_embeddings) == ("MistralConfig", 100,
                                                                           False)
    llama = build_model(ModelConfig(hf="llama", n_layers=3, ffn_dim=200), seed=1)
    shapes = {k: tuple(v.shape) for k, v in llama.state_dict().items()}
    assert shapes["model.layers.2.mlp.up_proj.weight"] == (200, 128)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (2 * 16, 128)  # 2 KV heads
    assert llama.training and llama.config.use_cache is False
    again = build_model(ModelConfig(hf="llama", n_layers=3, ffn_dim=200), seed=1)
    other = build_model(ModelConfig(hf="llama", n_layers=3, ffn_dim=200), seed=2)
    w = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(llama.state_dict()[w], again.state_dict()[w])
    assert not torch.equal(llama.state_dict()[w], other.state_dict()[w])


@pytest.mark.parametrize("kw,needle", [
    (dict(hf="gpt2"), "model.hf='gpt2' is not one of llama, qwen2, mistral"),
    # model.pretrained without model.hf is the built-in model from a checkpoint (test_pretrained)
    (dict(hf="llama", arch="qwen2"), "model.arch=qwen2 but model.hf=llama"),
    (dict(hf="llama", sliding_window=64), "model.hf=llama has no sliding window"),
    (dict(hf="mistral", sliding_window=64, full_attention_every=2),
     "model.hf=mistral windows every layer"),
])
def test_model_config_refuses_what_transformers_cannot_build(kw, needle):
    with pytest.raises(ValueError, match=needle):
        check_model(ModelConfig(**kw))


def test_preflight_refuses_a_missing_pretrained_directory(tmp_path):
    cfg = small_cfg(tmp_path / "run", model=ModelConfig(hf="llama", pretrained=str(tmp_path)))
    with pytest.raises(ValueError, match="no config.json there"):
        resolve_run(cfg, 4, "cpu")


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        return cli.to_config(compose(name, overrides=overrides))


def _nearest_pair_gaps(task: RecallTask, rows: int) -> np.ndarray:
    """For every question of ``rows`` sequences: how far back (query position minus pair
    position) the nearest copy of the asked pair token sits."""
    gaps = []
    for i in range(rows):
        tokens, labels = task.sample(i)
        for q in np.flatnonzero(labels >= 0):
            key, value = tokens[q] - task.query_base, labels[q] - task.value_base
            pair = task.pair_base + key * task.n_values + value
            gaps.append(q - np.flatnonzero(tokens[:q] == pair).max())
    return np.array(gaps)


@pytest.mark.parametrize("option", ["hf_mistral", "hf_qwen2"])
def test_tiny_windows_hide_context_yet_every_layer_reaches_the_pairs(option):
    """With the run's recall data, each windowed layer hides the start of the dictionary
    from every question (the window is real), and every layer reaches a copy of the asked
    pair for all but a rare question (the task is learnable: with a layer that reaches it
    in only ~6 of 10 questions, hf_qwen2 stayed at chance for 600 steps)."""
    cfg = _compose("train", [f"model={option}"])
    mc, dc = cfg.model, cfg.data
    task = build_dataset(dc, mc).source
    windows = [mc.layer_window(i) for i in range(mc.n_layers)]
    windowed = [w for w in windows if w is not None]
    assert windowed and max(windowed) < dc.seq_len
    first_question = task.query_start + 1
    assert all(first_question - task.pair_lo >= w for w in windowed)  # dictionary start hidden
    gaps = _nearest_pair_gaps(task, 200)  # 1600 questions
    assert gaps.min() >= first_question - task.pair_hi  # the pairs are far: no local shortcut
    assert (gaps < min(windowed)).mean() >= 0.999, (option, min(windowed), gaps.max())


# The fields of the config.json each checkpoint ships that fix its shape (Llama-3.1-8B
# brings its llama3 RoPE scaling; Qwen2-7B a window that use_sliding_window=false turns off).
PUBLISHED = {
    "hf_llama3_8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=False),
    "hf_qwen2_7b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064,
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072,
        max_window_layers=28, max_position_embeddings=131072, tie_word_embeddings=False),
    "hf_mistral_7b": dict(
        model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=4096, max_position_embeddings=32768, tie_word_embeddings=False),
}
# recipe -> (model option, (ulysses, ring))
HF_RECIPES = {"hf_llama3_8b_128k_h100x16": ("hf_llama3_8b", (8, 2)),
              "hf_qwen2_7b_128k_h100x16": ("hf_qwen2_7b", (4, 4)),
              "hf_mistral_7b_128k_h100x16": ("hf_mistral_7b", (8, 2))}


@pytest.mark.parametrize("recipe", sorted(HF_RECIPES))
def test_large_hf_recipe_passes_preflight_and_plans(recipe, tmp_path, capsys):
    """The recipe at 128K with model.pretrained = a directory holding the published
    config.json passes preflight on CUDA with its degrees, refuses another checkpoint's
    directory, and usp-plan plans the recipe's layout."""
    option, (u, r) = HF_RECIPES[recipe]
    for name, published in PUBLISHED.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(published))
    cfg = _compose("train", [f"recipe={recipe}", f"model.pretrained={tmp_path / option}"])
    assert cfg.model == _compose("train", [f"model={option}",
                                           f"model.pretrained={tmp_path / option}"]).model
    assert cfg.data.seq_len == 131072 and cfg.model.hf == PUBLISHED[option]["model_type"]
    world = cfg.cluster.nodes * cfg.cluster.ranks_per_node
    run = resolve_run(cfg, world, "cuda")
    assert (run.ulysses, run.ring) == (u, r)
    other = next(n for n in PUBLISHED if n != option)
    cfg.model.pretrained = str(tmp_path / other)
    with pytest.raises(ValueError, match=f"model.pretrained={tmp_path / other}"):
        resolve_run(cfg, world, "cuda")

    cli._plan(_compose("plan", [f"recipe={recipe}"]))
    out = capsys.readouterr().out
    assert f"world {world} " in out and "seq_len 131072" in out
    assert f"choice: dp 1 x ring {r} x ulysses {u}" in out


def test_a_mixture_of_experts_is_priced_by_its_experts(tmp_path, capsys):
    """model.hf=gpt_oss (experts): usp-plan prices the checkpoint's experts (read into the
    model keys), and parallel degrees left to the planner resolve; expert parallelism is the
    built-in model's, refused here by name. A Gemma 3 text checkpoint (dense) plans."""
    from _pretrained import save_checkpoint

    for kind in ("gpt_oss", "gemma3_text"):
        save_checkpoint(kind, tmp_path / kind)
    args = ["model=pretrained", f"model.pretrained={tmp_path / 'gpt_oss'}", "model.hf=gpt_oss",
            "data.seq_len=128"]
    cli._plan(_compose("plan", args))
    assert "experts: 3 sparse layers x 8 experts of 128, top-2" in capsys.readouterr().out
    cfg = _compose("train", [*args, "parallel.ulysses_degree=auto", "parallel.ring_degree=auto"])
    layout = resolve_run(cfg, 4, "cpu")
    assert layout.ulysses * layout.ring * layout.dp == 4 and layout.expert_degree == 1
    cfg = _compose("train", [*args, "parallel.ulysses_degree=2", "parallel.ring_degree=2",
                             "parallel.expert_degree=2"])
    with pytest.raises(ValueError, match="parallel.expert_degree=2: model.hf=gpt_oss computes "
                                         "transformers' own experts"):
        resolve_run(cfg, 4, "cpu")
    cli._plan(_compose("plan", ["model=pretrained", "model.hf=gemma3_text", "data.seq_len=128",
                                f"model.pretrained={tmp_path / 'gemma3_text'}"]))
    assert "choice: dp" in capsys.readouterr().out
