"""Qwen3-MoE on the built-in model (usp/models/qwen3_moe, expert degree 1): the tiny checkpoint
(4 experts, top 2, layer 1 dense) loads its per-expert tensors stacked into the fused [E, ...]
weights, whole or rank by rank; the logits, the loss and every parameter's gradient equal
transformers' Qwen3MoeForCausalLM (eager, fp32); the tiled MLP, chunked LM head and activation
checkpointing change nothing; the export reloads with equal logits; model.hf=qwen3_moe still
reads the checkpoint; what the family cannot hold is refused by name."""

import json
from dataclasses import replace

import pytest
import torch

from usp.config import ModelConfig
from usp.models.families import check_model, check_priced
from usp.models.hf_model import build_model, check_pretrained
from usp.models.pretrained import load_state, pretrained_config

from _pretrained import (checkpoint_model, export_run, hf_config, hf_eager,
                         memory_features_agree, rank_by_rank_load_agrees, rel_err,
                         save_checkpoint, transformers_agree)

pytest.importorskip("transformers")
TOKENS = torch.randint(0, 128, (2, 25), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe") / "ckpt")








def test_the_checkpoint_is_read_with_its_experts_and_sparse_layers(ckpt):
    mc = pretrained_config(ckpt)
    assert (mc.arch, mc.ffn_dim, mc.n_experts, mc.experts_per_token, mc.expert_ffn_dim,
            mc.norm_topk_prob, mc.sparse_layers) == ("qwen3_moe", 128, 8, 2, 48, False, [0, 2])
    state = load_state(mc)
    assert state["layers.0.feed_forward.experts.gate_up_proj"].shape == (8, 96, 64)
    assert state["layers.2.feed_forward.experts.down_proj"].shape == (8, 64, 48)
    assert state["layers.1.feed_forward.w1.weight"].shape == (128, 64)  # the dense layer
    assert replace(mc, pretrained=None).num_params() == sum(t.numel() for t in state.values())


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_loss_and_every_gradient_are_transformers(ckpt, tmp_path, norm_topk_prob):
    """The checkpoint as saved (norm_topk_prob false), and with the top-k weights
    renormalised and every layer sparse."""
    path = ckpt
    if norm_topk_prob:
        path = tmp_path / "all_sparse"
        cfg = json.loads((ckpt / "config.json").read_text())
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": True,
                                                      "mlp_only_layers": []}))
        hc = hf_config("qwen3_moe")
        hc.norm_topk_prob, hc.mlp_only_layers = True, []
        from transformers import AutoModelForCausalLM
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(hc).save_pretrained(path)
    mc = pretrained_config(path)
    assert mc.norm_topk_prob == norm_topk_prob
    transformers_agree(mc, checkpoint_model(mc), hf_eager(path), TOKENS,
                       torch.arange(TOKENS.shape[1]))


def test_the_rank_by_rank_load_stacks_the_same_experts(ckpt):
    rank_by_rank_load_agrees(pretrained_config(ckpt))


@pytest.mark.parametrize("options", [dict(mlp_tiles=3), dict(loss_chunk=7),
                                     dict(part="block"), dict(part="attention"),
                                     dict(part="mlp")])
def test_the_memory_features_change_nothing(ckpt, options):
    """In fp64: the tiled sparse MLP, the chunked LM head and each activation-checkpointed
    part give the plain model's loss and gradients."""
    memory_features_agree(checkpoint_model, pretrained_config(ckpt), options, TOKENS,
                          torch.arange(25))


def test_the_export_reloads_as_qwen3_moe_with_the_runs_logits(ckpt, tmp_path):
    from transformers import AutoConfig

    mc = pretrained_config(ckpt)
    model = checkpoint_model(mc).eval()
    export_run(model, mc, tmp_path)  # the run's own weights, exported
    hc = AutoConfig.from_pretrained(tmp_path / "out")
    assert (hc.model_type, hc.num_experts, hc.num_experts_per_tok, hc.moe_intermediate_size,
            hc.intermediate_size, hc.mlp_only_layers, hc.norm_topk_prob) == (
        "qwen3_moe", 8, 2, 48, 128, [1], False)
    with torch.no_grad():
        got = hf_eager(tmp_path / "out").eval()(input_ids=TOKENS).logits
        assert rel_err(got, model(TOKENS, torch.arange(25))) < 1e-5
    assert pretrained_config(tmp_path / "out").sparse_layers == [0, 2]  # and it reads back


def test_model_hf_qwen3_moe_reads_the_checkpoint_and_refuses_the_router_loss(ckpt, tmp_path):
    """model.hf=qwen3_moe: transformers' class from the checkpoint (the same shape and experts
    read), whose logits are the built-in model's; without a checkpoint, refused by name."""
    import shutil

    mc = pretrained_config(ckpt, hf="qwen3_moe")
    assert (mc.hf, mc.arch, mc.ffn_dim, mc.n_experts, mc.sparse_layers) == (
        "qwen3_moe", None, 128, 8, [0, 2])
    check_model(mc)
    with torch.no_grad():
        assert rel_err(build_model(mc, 0).eval()(input_ids=TOKENS).logits,
                    checkpoint_model(pretrained_config(ckpt)).eval()(TOKENS, torch.arange(25))) < 1e-5
    with pytest.raises(ValueError, match="moe_intermediate_size: 48 there, 32 from model.expert_ffn_dim"):
        check_pretrained(replace(mc, expert_ffn_dim=32))
    with pytest.raises(ValueError, match="model.hf=qwen3_moe trains from a checkpoint"):
        check_model(replace(mc, pretrained=None))
    shutil.copytree(ckpt, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "output_router_logits": True,
                                "router_aux_loss_coef": 0.02}))
    assert pretrained_config(tmp_path / "ckpt").router_aux_loss_coef == 0.02  # the built-in's
    with pytest.raises(ValueError, match="model.router_aux_loss_coef=0.02: a model.hf run"):
        pretrained_config(tmp_path / "ckpt", hf="qwen3_moe")


def test_what_the_family_cannot_hold_is_refused_by_name(ckpt):
    mc = pretrained_config(ckpt)
    with pytest.raises(ValueError, match="model.arch=qwen3_moe windows every layer or none"):
        check_model(replace(mc, sliding_window=8, full_attention_every=2))
    check_priced(mc, "usp-plan")  # the planner prices its experts (unit/test_planner_experts)
    with pytest.raises(ValueError, match="model.n_experts=8 but model.arch=qwen3 has no such"):
        check_model(replace(mc, arch="qwen3", sparse_layers=None))
    with pytest.raises(ValueError, match="model.n_experts=8 needs model.expert_ffn_dim"):
        replace(mc, expert_ffn_dim=None)
    with pytest.raises(ValueError, match="model.norm_topk_prob=True without model.n_experts"):
        ModelConfig(norm_topk_prob=True)
