"""The mixture-of-experts blocks (``usp.models.moe``) against transformers 5.x: Qwen3-MoE's
sparse block and gpt-oss's MLP, weights copied by ``HF_RENAMES``, output and every gradient
equal in fp64 and close in fp32; gpt-oss's clamp active; dropless when every token picks the
same expert. The load-balancing statistics (``usp.models.moe_loss``): transformers'
``load_balancing_loss_func`` on the router logits of a 2-layer model run with
``output_router_logits=True``, and the same loss pooled from two halves of the batch, as two
sequence-parallel ranks hold it, with each half's share carrying the whole loss's gradient."""

import pytest
import torch
from transformers import (GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import (Qwen3MoeSparseMoeBlock,
                                                               load_balancing_loss_func)

from usp.models.moe import GptOssMoeBlock, Qwen3MoeBlock
from usp.models.moe_loss import balance_loss, balance_loss_share, pool

D, E, K, F_ = 32, 8, 2, 16
REL = {torch.float64: 1e-12, torch.float32: 1e-6}  # max |ours - theirs| / max |theirs|
SMALL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             vocab_size=64, max_position_embeddings=4096, use_cache=False)


def qwen_config(norm_topk_prob=True, **kw):
    return Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K,
                          moe_intermediate_size=F_, norm_topk_prob=norm_topk_prob,
                          experts_implementation="eager", **kw)


def oss_config(**kw):
    return GptOssConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=K,
                        intermediate_size=F_, experts_implementation="eager", **kw)


def ours_of(theirs, family, norm_topk_prob=True):
    """Our block with transformers' block's weights, copied by the block's HF_RENAMES."""
    block = (Qwen3MoeBlock(D, E, K, F_, norm_topk_prob) if family == "qwen3_moe"
             else GptOssMoeBlock(D, E, K, F_))
    block.to(next(theirs.parameters()).dtype)
    hf = theirs.state_dict()
    block.load_state_dict({n: hf[block.HF_RENAMES.get(n, n)] for n in block.state_dict()})
    return block


def theirs_of(family, norm_topk_prob=True, seed=0):
    """transformers' block alone (its parameters left uninitialised by it), drawn here: a
    router wide enough to route unevenly, nonzero biases."""
    torch.manual_seed(seed)
    block = (Qwen3MoeSparseMoeBlock(qwen_config(norm_topk_prob)) if family == "qwen3_moe"
             else GptOssMLP(oss_config()))
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0.0, 0.5 if name.startswith(("gate.", "router.")) else 0.2)
    return block


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def check_block(ours, theirs, x, dtype):
    """Outputs, the input's gradient and every parameter's gradient within REL[dtype]."""
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    xa, xb = (x.to(dtype).clone().requires_grad_() for _ in range(2))
    ya, _ = ours(xa)
    yb = theirs(xb)
    yb = yb[0] if isinstance(yb, tuple) else yb  # GptOssMLP also returns its routing weights
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=dtype)
    ya.backward(dy)
    yb.backward(dy)
    assert ya.dtype == yb.dtype == dtype and ya.abs().max() > 0
    assert rel(ya, yb) <= REL[dtype], "output"
    assert rel(xa.grad, xb.grad) <= REL[dtype], "input grad"
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs_params[ours.HF_RENAMES.get(name, name)]
        assert p.shape == q.shape, name
        assert q.grad.abs().max() > 0, name
        assert rel(p.grad, q.grad) <= REL[dtype], name


def draw(shape, scale=1.0, seed=1):
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block_equals_transformers(norm_topk_prob, dtype):
    theirs = theirs_of("qwen3_moe", norm_topk_prob).double()
    ours = ours_of(theirs, "qwen3_moe", norm_topk_prob)
    check_block(ours, theirs, draw((3, 10, D)), dtype)


def clamp_active(block, x):
    """How many routed (token, expert) gate and up entries lie beyond swiglu_limit."""
    x = x.reshape(-1, D).to(block.router.weight.dtype)
    idx = torch.topk(block.router(x), K, dim=-1).indices  # [n, K]
    ex = block.experts
    pre = torch.einsum("nd,nkdf->nkf", x, ex.gate_up_proj[idx]) + ex.gate_up_proj_bias[idx]
    gate, up = pre[..., 0::2], pre[..., 1::2]
    return int((gate > ex.limit).sum()), int((up.abs() > ex.limit).sum()), gate.numel()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gpt_oss_mlp_equals_transformers_with_the_clamp_active(dtype):
    theirs = theirs_of("gpt_oss").double()
    ours = ours_of(theirs, "gpt_oss")
    x = draw((3, 10, D), scale=3.0)
    gate_over, up_over, total = clamp_active(ours, x)
    assert 0 < gate_over < total and 0 < up_over < total, (gate_over, up_over, total)
    check_block(ours, theirs, x, dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_dropless_when_every_token_picks_the_same_expert(family):
    theirs = theirs_of(family).double()
    router = theirs.gate if family == "qwen3_moe" else theirs.router
    x = draw((2, 12, D)).abs() + 0.1  # positive entries: a positive router row wins
    with torch.no_grad():
        router.weight[3] = 0.5  # a logit near 14 against others of spread ~3
    ours = ours_of(theirs, family)
    _, stats = ours(x)
    assert stats.counts[3] == 24 and stats.counts.sum() == 24 * K
    check_block(ours, theirs, x, torch.float64)


# --- the load-balancing loss ---------------------------------------------------------------

def model_of(family, seed=0):
    """A 2-layer transformers model whose MoE layers route unevenly, and its batch."""
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(qwen_config(**SMALL, output_router_logits=True))
    else:
        model = GptOssForCausalLM(oss_config(**SMALL, output_router_logits=True,
                                             sliding_window=4))
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.gate if family == "qwen3_moe" else layer.mlp.router
            router.weight.normal_(0.0, 1.0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    return model, ids


def layer_inputs_and_loss(model, ids):
    """Each MoE block's input [B, L, D] and the model's aux loss from one forward (its own
    family's ``load_balancing_loss_func``, the same as Qwen3-MoE's on its router logits)."""
    seen = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
             for layer in model.model.layers]
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    for h in hooks:
        h.remove()
    assert len(out.router_logits) == 2
    theirs = load_balancing_loss_func(out.router_logits, E, K)
    assert torch.equal(out.aux_loss, theirs)
    return seen, out.aux_loss


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_balance_loss_equals_transformers_whole_and_from_two_halves(family):
    model, ids = model_of(family)
    inputs, theirs = layer_inputs_and_loss(model, ids)
    blocks = [ours_of(layer.mlp, family) for layer in model.model.layers]
    whole = [blk(h)[1] for blk, h in zip(blocks, inputs)]
    loss = balance_loss(whole, E)
    assert abs(loss.item() - theirs.item()) <= 1e-6 * theirs.item()
    assert loss.item() > 1.02 * K  # uneven: an even routing gives exactly k
    # two sequence-parallel ranks: the first and the second half of each sequence
    halves = [[blk(h[:, part])[1] for blk, h in zip(blocks, inputs)]
              for part in (slice(0, 6), slice(6, 12))]
    pooled = pool(s for rank in halves for s in rank)
    assert torch.equal(pooled.counts, pool(whole).counts) and pooled.tokens == 2 * 24
    assert abs(balance_loss(pooled, E).item() - theirs.item()) <= 1e-6 * theirs.item()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_each_ranks_share_carries_the_whole_losses_gradient(family):
    model, ids = model_of(family)
    inputs, theirs = layer_inputs_and_loss(model, ids)
    blocks = [ours_of(layer.mlp, family) for layer in model.model.layers]
    balance_loss([blk(h)[1] for blk, h in zip(blocks, inputs)], E).backward()
    want = [blk.router.weight.grad.clone() for blk in blocks]
    for blk in blocks:
        blk.zero_grad()
    ranks = [pool(blk(h[:, part])[1] for blk, h in zip(blocks, inputs))
             for part in (slice(0, 6), slice(6, 12))]
    everyone = pool(r.detach() for r in ranks)  # what an all-reduce of the integers gives
    shares = [balance_loss_share(r, everyone, E) for r in ranks]
    assert abs(sum(shares).item() - theirs.item()) <= 1e-6 * theirs.item()
    for s in shares:
        s.backward()
    for blk, w in zip(blocks, want):
        assert w.abs().max() > 0
        assert rel(blk.router.weight.grad, w) <= 1e-6


def test_the_start_line_says_the_expert_degree_and_how_the_router_loss_pools():
    from usp.config import ModelConfig
    from usp.run.resolve import router_loss_note

    moe = dict(n_experts=8, experts_per_token=2, expert_ffn_dim=16, norm_topk_prob=True)
    assert router_loss_note(ModelConfig(), 1, 1) is None  # a dense model
    assert router_loss_note(ModelConfig(**moe), 1, 4) == (
        "8 experts a sparse layer, expert degree 4; no router loss "
        "(model.router_aux_loss_coef=0)")
    note = router_loss_note(ModelConfig(**moe, router_aux_loss_coef=0.01,
                                        router_balance_over="dp"), 3, 2)
    assert note.startswith("8 experts a sparse layer, expert degree 2; router loss x 0.01 "
                           "pooled over the global batch, formed per micro-batch (3 a step)")
