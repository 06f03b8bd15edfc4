"""Single-process tests of the GQA decoder in usp.models.decoder."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from usp.config import ModelConfig
from usp.attention import local_attention
from usp.models.decoder import Transformer, flops_per_token
from usp.models.rope import apply_rope, rope_cos_sin

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
LOCAL = functools.partial(local_attention, causal=True)


def dense_attention(q, k, v, positions):
    """Plain masked attention where query i sees key j iff positions[j] <= positions[i]."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # [B, n, Hq, hd]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    mask = positions[None, :] <= positions[:, None]  # [n(query), n(key)]
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


class PositionedDense:
    """attn_fn with the causal mask taken from the global positions of the current call."""

    def __init__(self):
        self.positions = None

    def __call__(self, q, k, v):
        return dense_attention(q, k, v, self.positions)


def make(seed=0, attn_fn=LOCAL, **kw):
    cfg = ModelConfig(**{**CFG, **kw})
    model = Transformer(cfg, attn_fn)
    model.init_weights(seed)
    return model


def test_forward_shapes_and_param_count():
    for tie in (True, False):
        model = make(tie_embeddings=tie)
        tokens = torch.randint(0, 64, (2, 16))
        logits = model(tokens, torch.arange(16))
        assert logits.shape == (2, 16, 64) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        assert model.num_params() == model.cfg.num_params()
        assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 2
    with pytest.raises(ValueError, match=r"positions \[n\]"):
        model(tokens, torch.arange(15))


def test_rope_depends_only_on_position_value():
    pos = torch.arange(40)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(pos, 16, 10000.0)
    cos_p, sin_p = rope_cos_sin(pos[perm], 16, 10000.0)
    assert cos.shape == (40, 8) and cos.dtype == torch.float32
    torch.testing.assert_close(cos_p, cos[perm], rtol=0, atol=0)
    torch.testing.assert_close(sin_p, sin[perm], rtol=0, atol=0)
    # position 0 is the identity; norms are preserved; q.k depends on p_q - p_k only
    x = torch.randn(1, 40, 2, 16, dtype=torch.float64)
    rx = apply_rope(x, cos, sin)
    torch.testing.assert_close(rx[:, 0], x[:, 0])
    torch.testing.assert_close(rx.norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def dot(pq, pk):
        c, s = rope_cos_sin(torch.tensor([pq, pk]), 16, 10000.0)
        both = apply_rope(torch.stack([q, k])[None, :, None, :], c, s)[0, :, 0]  # [2, 16]
        return (both[0] * both[1]).sum()

    torch.testing.assert_close(dot(7, 3), dot(1007, 1003), rtol=1e-5, atol=1e-6)
    assert not torch.isclose(dot(7, 3), dot(7, 4))


def test_local_kernel_matches_dense_attention():
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    dense = PositionedDense()
    dense.positions = torch.arange(24)
    a = make(attn_fn=LOCAL)(tokens, torch.arange(24))
    b = make(attn_fn=dense)(tokens, torch.arange(24))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_zigzag_permuted_tokens_with_global_positions():
    # zigzag for ring=2: chunks [0,1,2,3] of 6 tokens -> order 0,3,1,2
    L = 24
    order = torch.cat([torch.arange(0, 6), torch.arange(18, 24), torch.arange(6, 18)])
    tokens = torch.randint(0, 64, (2, L), generator=torch.Generator().manual_seed(2))
    dense = PositionedDense()
    model = make(attn_fn=dense)
    dense.positions = torch.arange(L)
    full = model(tokens, torch.arange(L))
    dense.positions = order
    permuted = model(tokens[:, order], order)
    torch.testing.assert_close(permuted, full[:, order], rtol=1e-4, atol=1e-5)
    # contiguous positions on permuted tokens give a different answer (RoPE matters)
    dense.positions = torch.arange(L)
    wrong = model(tokens[:, order], torch.arange(L))
    assert (wrong[:, 6:12] - full[:, order][:, 6:12]).abs().max() > 1e-3


def test_init_is_deterministic_and_scaled():
    a, b, c = make(seed=3), make(seed=3), make(seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    # the same names get the same values whatever else the model holds
    untied = make(seed=3, tie_embeddings=False)
    assert torch.equal(untied.tok_embeddings.weight, a.tok_embeddings.weight)
    big = Transformer(ModelConfig(**{**CFG, "dim": 256, "n_heads": 4, "ffn_dim": 512}), LOCAL)
    big.init_weights(0)
    out_std = 0.02 / math.sqrt(2 * 2)
    assert abs(big.layers[0].attention.wo.weight.std().item() - out_std) < 0.1 * out_std
    assert abs(big.layers[0].feed_forward.w2.weight.std().item() - out_std) < 0.1 * out_std
    assert abs(big.layers[0].attention.wq.weight.std().item() - 0.02) < 0.002
    assert torch.equal(big.norm.weight, torch.ones(256))


def _grads(model, tokens):
    loss = model(tokens, torch.arange(tokens.shape[1])).float().logsumexp(-1).mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_flow_and_checkpointing_matches():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    plain = _grads(make(seed=1), tokens)
    assert all(g.abs().sum() > 0 for g in plain.values()), [
        n for n, g in plain.items() if g.abs().sum() == 0
    ]
    cfg = ModelConfig(**CFG)
    ckpt = Transformer(cfg, LOCAL, checkpoint_activations=True)
    ckpt.init_weights(1)
    grads = _grads(ckpt, tokens)
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_flops_per_token():
    for tie in (True, False):
        cfg = ModelConfig(**{**CFG, "tie_embeddings": tie})
        norms = (2 * cfg.n_layers + 1) * cfg.dim
        n_mm = cfg.num_params() - norms - (0 if tie else cfg.vocab_size * cfg.dim)
        L = 1000
        attn_causal = 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * (L + 1)
        assert flops_per_token(cfg, L) == 6 * n_mm + attn_causal
        assert flops_per_token(cfg, L, causal=False) == 6 * n_mm + 12 * cfg.n_layers * cfg.dim * L
        model = Transformer(cfg, LOCAL)
        assert model.flops_per_token(L) == flops_per_token(cfg, L)
    # a 7B-like shape at 4k: close to the usual 6N + 6*n_layers*dim*L estimate
    big = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      ffn_dim=11008, tie_embeddings=False)
    n = big.num_params() - big.vocab_size * big.dim
    approx = 6 * n + 6 * big.n_layers * big.dim * 4096
    assert abs(flops_per_token(big, 4096) / approx - 1) < 1e-3
