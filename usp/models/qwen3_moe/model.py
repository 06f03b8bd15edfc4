"""Qwen3-MoE on the shared decoder (``usp.models.decoder``): what differs is here.

Every block is the shared one with Qwen3's q/k norms; on a sparse layer
(``ModelConfig.sparse``: ``model.sparse_layers``, transformers' ``decoder_sparse_step`` and
``mlp_only_layers``) the MLP is ``usp.models.moe.Qwen3MoeBlock`` (``model.n_experts`` SwiGLU
experts of ``model.expert_ffn_dim``, ``model.experts_per_token`` a token), elsewhere the dense
SwiGLU ``FeedForward`` of ``model.ffn_dim`` (``intermediate_size``).

Expert degree 1: every rank holds every expert (FSDP shards the [E, ...] weights like any
other, along the expert dim) and routes its own tokens; nothing moves between ranks but
what FSDP gathers. The router's load-balancing statistics are dropped: the loss is the LM
loss alone (``output_router_logits`` is refused, ``usp.models.family.refuse_router_loss``).

Memory features: the experts are token-wise, so ``model.mlp_tiles`` tiles a sparse MLP too
(each tile routed on its own: the same experts and weights per token), the LM head's
``model.loss_chunk`` is the shared one, and activation checkpointing recomputes a sparse MLP
as it does a dense one (``mlp``, ``block``; the routing is recomputed from the same input).
"""

from __future__ import annotations

from ...config import ModelConfig
from ..decoder import AttnFn, Block, Transformer
from ..moe import Qwen3MoeBlock
from ..sparse_mlp import SparseMlp


class Qwen3SparseMlp(SparseMlp, Qwen3MoeBlock):
    """``Qwen3MoeBlock`` as a decoder MLP (``usp.models.sparse_mlp.SparseMlp``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.dim, cfg.n_experts, cfg.experts_per_token, cfg.expert_ffn_dim,
                         cfg.norm_topk_prob)
        self.tiles = cfg.mlp_tiles


class Qwen3Moe(Transformer):
    """The shared ``Transformer`` whose sparse layers (``cfg.sparse``) have a ``SparseMlp``
    as their MLP; the others are the shared ``Block``."""

    def make_block(self, cfg: ModelConfig, attn_fn: AttnFn, layer: int) -> Block:
        mlp = Qwen3SparseMlp(cfg) if cfg.sparse(layer) else None
        return Block(cfg, attn_fn, cfg.layer_window(layer), mlp=mlp)
