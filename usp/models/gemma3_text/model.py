"""Gemma 3's text decoder on the shared one (``usp.models.decoder``): what differs is here.

- Every RMSNorm multiplies by ``1 + weight`` (the weight stored as its offset from one, zero
  at init), in fp32 like the shared norm; the q/k norms too.
- A block norms each part's output as well as its input: ``h + post(attention(pre(h)))``,
  then ``h + post(mlp(pre(h)))`` (``input_layernorm`` / ``post_attention_layernorm``,
  ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``); the post norms are inside
  the parts the activation checkpoints recompute (``Block._attention``, ``Block._mlp``).
- The MLP is GeGLU: ``down(gelu_tanh(gate x) * up x)`` (``gelu_pytorch_tanh``).
- The embeddings are multiplied by ``sqrt(dim)``, rounded to their dtype first as
  transformers does (in bf16, sqrt(1152) = 33.94 becomes 34.0).

What the shared decoder takes from the config serves Gemma as it is: the attention scale
(``model.query_pre_attn_scalar``), a RoPE per layer type (``model.local_rope_theta`` on the
sliding layers, ``model.rope_theta`` / ``model.rope_scaling`` on the full ones), the windows,
the q/k norms, the chunked loss and tiled MLP, activation checkpointing and offload.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...config import ModelConfig
from ..decoder import AttnFn, Block, RMSNorm, Transformer

gelu_tanh = functools.partial(F.gelu, approximate="tanh")  # transformers' gelu_pytorch_tanh


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): zero weights are the identity."""

    def gain(self) -> torch.Tensor:
        return 1.0 + self.weight.float()


class GemmaBlock(Block):
    """h + post_attention_norm(attention(attention_norm(h))), then h + post_ffn_norm(GeGLU(
    ffn_norm(h))); [B, n, D] -> [B, n, D]."""

    def __init__(self, cfg: ModelConfig, attn_fn: AttnFn, window: int | None = None):
        super().__init__(cfg, attn_fn, window, norm=GemmaRMSNorm, act=gelu_tanh)
        self.post_attention_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.post_ffn_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)

    def _attention(self, h, cos, sin, segment_ids):
        return self.post_attention_norm(super()._attention(h, cos, sin, segment_ids))

    def _mlp(self, h):
        return self.post_ffn_norm(super()._mlp(h))


class Gemma3Text(Transformer):
    """The shared ``Transformer`` with Gemma 3's blocks, norms and embedding scale; RMSNorm
    weights are initialised to zero (a gain of one)."""

    block = GemmaBlock
    final_norm = GemmaRMSNorm

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # [B, n] -> [B, n, D]
        return h * torch.tensor(self.cfg.dim ** 0.5, dtype=h.dtype, device=h.device)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        super().init_weights(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.zero_()
