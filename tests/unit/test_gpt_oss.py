"""gpt-oss on the built-in model (usp/models/gpt_oss, expert degree 1): a tiny checkpoint written
by transformers (8 experts, top 2, 3 layers, a band on layers 0 and 2, YaRN without truncation,
sinks, q/k/v and o_proj biases, a clamp of 0.1 that bites and a swiglu_alpha of its own) is
read with its experts, loads whole or rank by rank, and gives transformers' GptOssForCausalLM's
logits, loss and every parameter's gradient (eager, fp32), on usp's torch and reference
kernels; the memory features change nothing; the export reloads as gpt_oss with the run's
logits; model.hf=gpt_oss still trains transformers' class; what the family cannot hold is
refused by name. An MXFP4 copy of the checkpoint (its expert weights packed into e2m1 blocks
and scales by the tests' own packer, _pretrained.pack_mxfp4) loads, whole or rank by rank, as
the unquantized checkpoint whose expert weights transformers' own dequantizer made from those
bytes: bit for bit."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from usp.config import ParallelConfig, RunConfig
from usp.models import mxfp4
from usp.models.families import builtin_model, check_model, check_priced, hf_names
from usp.models.hf_model import build_model
from usp.models.pretrained import check_checkpoint, load_state, pretrained_config
from usp.models.shard_load import load_shards
from usp.run import check_run_masks

from _pretrained import (LOCAL, REFERENCE, checkpoint_model, export_run, hf_eager,
                         memory_features_agree, rank_by_rank_load_agrees, rel_err,
                         save_checkpoint, save_mxfp4, transformers_agree)

pytest.importorskip("transformers")
TOKENS = torch.randint(0, 128, (2, 25), generator=torch.Generator().manual_seed(1))
POSITIONS = torch.arange(25)
# beside _pretrained's gpt-oss: 8 experts, a clamp most gates and ups reach, another alpha
CHANGES = dict(num_local_experts=8, swiglu_limit=0.1, swiglu_alpha=1.5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "ckpt", **CHANGES)








def test_the_checkpoint_is_read_with_its_experts_sinks_and_biases(ckpt):
    mc = pretrained_config(ckpt)
    check_checkpoint(mc)
    assert (mc.arch, mc.qkv_bias, mc.o_bias, mc.attention_sinks, mc.n_experts,
            mc.experts_per_token, mc.expert_ffn_dim, mc.norm_topk_prob, mc.sparse_layers,
            mc.swiglu_limit, mc.swiglu_alpha) == ("gpt_oss", True, True, True, 8, 2, 128, None,
                                                  None, 0.1, 1.5)
    assert (mc.sliding_window, mc.layer_types[1], mc.rope_scaling["truncate"]) == (
        6, "full_attention", False)
    assert mc.ffn_dim == 2 * 128  # the experts a token runs: what a dense layer would count
    state = load_state(mc)
    assert state["layers.0.feed_forward.experts.gate_up_proj"].shape == (8, 64, 256)
    assert state["layers.2.feed_forward.experts.down_proj_bias"].shape == (8, 64)
    assert state["layers.1.attention.sinks"].shape == (4,)
    assert "layers.1.feed_forward.w1.weight" not in state  # no dense MLP
    assert replace(mc, pretrained=None).num_params() == sum(t.numel() for t in state.values())


@pytest.mark.parametrize("attn", [LOCAL, REFERENCE], ids=["torch", "reference"])
def test_logits_loss_and_every_gradient_are_transformers(ckpt, attn):
    mc = pretrained_config(ckpt)
    assert len(hf_names(mc)) == len(dict(hf_eager(ckpt).named_parameters()))
    transformers_agree(mc, checkpoint_model(mc, attn), hf_eager(ckpt), TOKENS, POSITIONS)


def test_the_rank_by_rank_load_reads_the_same_weights(ckpt):
    rank_by_rank_load_agrees(pretrained_config(ckpt))


@pytest.mark.parametrize("options", [dict(mlp_tiles=3), dict(loss_chunk=7),
                                     dict(part="block"), dict(part="attention"),
                                     dict(part="mlp")])
def test_the_memory_features_change_nothing(ckpt, options):
    """In fp64: the tiled experts, the chunked LM head and each activation-checkpointed part
    give the plain model's loss and gradients (the sinks' among them)."""
    memory_features_agree(checkpoint_model, pretrained_config(ckpt), options, TOKENS, POSITIONS)


def test_the_export_reloads_as_gpt_oss_with_the_runs_logits(ckpt, tmp_path):
    from transformers import AutoConfig

    mc = pretrained_config(ckpt)
    model = checkpoint_model(mc).eval()
    export_run(model, mc, tmp_path)  # the run's own weights, exported
    hc = AutoConfig.from_pretrained(tmp_path / "out")
    assert (hc.model_type, hc.num_local_experts, hc.num_experts_per_tok, hc.intermediate_size,
            hc.swiglu_limit, hc.swiglu_alpha, hc.attention_bias, hc.layer_types,
            hc.sliding_window) == ("gpt_oss", 8, 2, 128, 0.1, 1.5, True,
                                   ["sliding_attention", "full_attention", "sliding_attention"], 6)
    assert hc.rope_parameters["rope_type"] == "yarn" and not hc.rope_parameters["truncate"]
    with torch.no_grad():
        got = hf_eager(tmp_path / "out").eval()(input_ids=TOKENS).logits
        assert rel_err(got, model(TOKENS, POSITIONS)) < 1e-5
    back = pretrained_config(tmp_path / "out")  # and it reads back as the same model
    assert replace(back, pretrained=None) == replace(mc, pretrained=None)


def test_model_hf_gpt_oss_still_trains_transformers_class(ckpt, tmp_path):
    """model.hf=gpt_oss: transformers' class from the checkpoint (the same shape read), whose
    logits are the built-in model's; without a checkpoint, or with a router loss a model.hf
    run would drop, refused by name (the built-in model keeps the loss's weight)."""
    mc = pretrained_config(ckpt, hf="gpt_oss")
    assert (mc.hf, mc.arch, mc.n_experts, mc.attention_sinks) == ("gpt_oss", None, 8, True)
    check_model(mc)
    with torch.no_grad():
        assert rel_err(build_model(mc, 0).eval()(input_ids=TOKENS).logits,
                    checkpoint_model(pretrained_config(ckpt)).eval()(TOKENS, POSITIONS)) < 1e-5
    with pytest.raises(ValueError, match="model.hf=gpt_oss trains from a checkpoint"):
        check_model(replace(mc, pretrained=None))
    shutil.copytree(ckpt, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "output_router_logits": True,
                                "router_aux_loss_coef": 0.25}))
    assert pretrained_config(tmp_path / "ckpt").router_aux_loss_coef == 0.25
    with pytest.raises(ValueError, match=r"model.router_aux_loss_coef=0.25: a model.hf run's "
                                         "loss is usp's LM loss alone"):
        pretrained_config(tmp_path / "ckpt", hf="gpt_oss")


def test_what_the_family_cannot_hold_is_refused_by_name(ckpt, tmp_path):
    mc = pretrained_config(ckpt)
    with pytest.raises(ValueError, match=r"model.sparse_layers=\[0, 2\] but model.arch=gpt_oss "
                                         "has no such setting"):
        check_model(replace(mc, sparse_layers=[0, 2]))
    with pytest.raises(ValueError, match="model.arch=gpt_oss: model.attention_sinks=False"):
        check_model(replace(mc, attention_sinks=False))
    with pytest.raises(ValueError, match="model.o_bias=True but model.arch=llama has no such"):
        check_model(replace(mc, arch="llama", n_experts=None, experts_per_token=None,
                            expert_ffn_dim=None, swiglu_limit=None, swiglu_alpha=None,
                            attention_sinks=False))
    with pytest.raises(ValueError, match="model.norm_topk_prob=True with model.swiglu_limit=0.1"):
        replace(mc, norm_topk_prob=True)
    with pytest.raises(ValueError, match="model.n_experts=8 needs model.swiglu_alpha"):
        replace(mc, swiglu_alpha=None)
    check_priced(mc, "usp-plan")  # its experts stated: the planner prices them
    run = RunConfig(model=mc, parallel=ParallelConfig(ring_impl="ring_flash_attn"))
    with pytest.raises(ValueError, match="model.attention_sinks=true with parallel.ring_impl="
                                         "ring_flash_attn: ring_impl='ring_flash_attn' cannot "
                                         "apply sinks"):
        check_run_masks(run)  # before launch, as every mask the ring engine cannot apply
    check_run_masks(replace(run, parallel=ParallelConfig()))
    shutil.copytree(ckpt, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="quantization_config.quant_method='fp8': usp reads "
                                         "gpt-oss weights unquantized or in MXFP4 only"):
        pretrained_config(tmp_path / "ckpt")


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_twin(ckpt, tmp_path):
    """The experts packed in MXFP4 (quantization_config mxfp4) load whole and rank by rank as
    the twin whose expert weights are transformers' dequantization of the same bytes
    (convert_moe_packed_tensors): equal weights, transformers' logits within 1e-5; and
    within the format's rounding of the unquantized checkpoint's logits (e2m1 keeps 2
    significant bits; the logits here move by 1.6e-3 of their largest, asserted below 1e-2)."""
    save_mxfp4(ckpt, tmp_path / "mxfp4", tmp_path / "twin")
    mc = pretrained_config(tmp_path / "mxfp4")
    check_checkpoint(mc)
    assert replace(mc, pretrained=None) == replace(pretrained_config(ckpt), pretrained=None)
    got, want = load_state(mc), load_state(pretrained_config(tmp_path / "twin"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with torch.device("meta"):
        model = builtin_model(mc, LOCAL)
    load_shards(model, mc, "cpu")  # one rank: every expert, one at a time
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    name = "model.layers.1.mlp.experts.down_proj"
    from safetensors import safe_open
    with safe_open(str(tmp_path / "mxfp4" / "model.safetensors"), framework="pt") as st:
        assert torch.equal(mxfp4.read_experts(lambda _: st, name, 3, 2),  # a rank's experts
                           want["layers.1.feed_forward.experts.down_proj"][3:5])
    with torch.no_grad():
        logits = model.eval()(TOKENS, POSITIONS)
        assert rel_err(logits, hf_eager(tmp_path / "twin")(input_ids=TOKENS).logits) < 1e-5
        off = rel_err(logits, hf_eager(ckpt)(input_ids=TOKENS).logits)  # the rounding: 1.6e-3
        assert 1e-5 < off < 1e-2


def test_the_released_yarn_is_transformers():
    """GptOssConfig's defaults are the released models' RoPE (base 150000, head_dim 64, YaRN x 32
    over 4096 positions, beta 32 / 1, truncate false): the built-in frequencies and attention
    factor equal transformers' (fp32)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from usp.models.family import shape_fields
    from usp.models.rope import inverse_frequencies

    hc = GptOssConfig()
    mc = shape_fields(hc)
    assert (mc["rope_theta"], mc["rope_scaling"]["truncate"], mc["head_dim"]) == (
        150000.0, False, 64)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hc, "cpu")
    got, attention = inverse_frequencies(mc["head_dim"], mc["rope_theta"], mc["rope_scaling"])
    assert torch.allclose(got.float(), want, rtol=1e-6, atol=0)
    assert attention == pytest.approx(factor, rel=1e-12)
