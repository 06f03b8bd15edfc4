"""Plain math attention: the ground truth for tests (any dtype, fp64 included)."""

from __future__ import annotations

import torch

from .base import settle_empty_rows


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, Sk, Hkv, d] -> [B, Sk, Hkv * groups, d]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _scores(q, k, causal, scale, mask):
    # [B, S, H, d] x [B, Sk, H, d] -> [B, H, S, Sk], computed in >= fp32
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.einsum("bshd,bkhd->bhsk", q.to(ct), k.to(ct)) * scale
    if causal:
        tril = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~tril, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask.visible(s.device)[:, None], float("-inf"))  # [B|1, 1, S, Sk]
    return s


class ReferenceKernel:
    name = "reference"
    masks = frozenset({"window", "segment_ids"})

    def forward(self, q, k, v, causal, scale, mask=None):
        g = q.shape[2] // k.shape[2]
        s = _scores(q, _expand_kv(k, g), causal, scale, mask)
        lse = torch.logsumexp(s, dim=-1)  # [B, H, S]
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhsk,bkhd->bshd", p, _expand_kv(v, g).to(p.dtype))
        out, lse = settle_empty_rows(out, lse, mask)
        return out.to(q.dtype), lse.to(torch.promote_types(q.dtype, torch.float32))

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        g = q.shape[2] // k.shape[2]
        ke, ve = _expand_kv(k, g), _expand_kv(v, g)
        s = _scores(q, ke, causal, scale, mask)
        ct = s.dtype
        p = torch.exp(s - lse.to(ct).unsqueeze(-1))  # [B, H, S, Sk], exact global probabilities
        do = dout.to(ct)
        dv = torch.einsum("bhsk,bshd->bkhd", p, do)
        dp = torch.einsum("bshd,bkhd->bhsk", do, ve.to(ct))
        delta = (do * out.to(ct)).sum(-1).transpose(1, 2).unsqueeze(-1)  # [B, H, S, 1]
        ds = p * (dp - delta) * scale
        dq = torch.einsum("bhsk,bkhd->bshd", ds, ke.to(ct))
        dk = torch.einsum("bhsk,bshd->bkhd", ds, q.to(ct))
        if g > 1:  # sum the grads of the query heads that shared a KV head
            b, sk, h, d = dk.shape
            dk = dk.view(b, sk, h // g, g, d).sum(3)
            dv = dv.view(b, sk, h // g, g, d).sum(3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
