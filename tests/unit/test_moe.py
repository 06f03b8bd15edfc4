"""The mixture-of-experts blocks (``usp.models.moe``) against transformers 5.x: Qwen3-MoE's
sparse block and gpt-oss's MLP, weights copied by ``HF_RENAMES``, output and every gradient
equal in fp64 and close in fp32; gpt-oss's clamp active; dropless when every token picks the
same expert."""

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from usp.models.moe import GptOssMoeBlock, Qwen3MoeBlock

D, E, K, F_ = 32, 8, 2, 16
REL = {torch.float64: 1e-12, torch.float32: 1e-6}  # max |ours - theirs| / max |theirs|


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

