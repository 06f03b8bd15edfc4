"""gpt-oss on the shared decoder (``usp.models.decoder``): what differs is here.

Every block is the shared one with biases on q, k, v and o_proj (``model.qkv_bias``,
``model.o_bias``) and learned attention sinks (``model.attention_sinks``: one logit per query
head in each softmax, carrying no value; ``usp_attention`` folds them in once after the ring's
LSE merge, on every layout); its MLP is ``usp.models.moe.GptOssMoeBlock`` on every layer (a
router with bias, top-k of the logits then softmax over the k, ``model.n_experts`` clamped GLU
experts of ``model.expert_ffn_dim`` with biases, ``model.swiglu_limit``,
``model.swiglu_alpha``). Windows on the sliding layers (``layer_types``) and YaRN are the
shared decoder's.

Expert degree 1, as Qwen3-MoE (``usp.models.qwen3_moe.model``): every rank holds every expert
(FSDP shards the [E, ...] weights along the expert dim) and routes its own tokens. Memory
features: ``model.mlp_tiles`` tiles the experts (each tile routed on its own), the chunked LM
head, activation checkpointing and offload as for any block.
"""

from __future__ import annotations

from ...config import ModelConfig
from ..decoder import AttnFn, Block, Transformer
from ..moe import GptOssMoeBlock
from ..sparse_mlp import SparseMlp


class GptOssSparseMlp(SparseMlp, GptOssMoeBlock):
    """``GptOssMoeBlock`` as a decoder MLP (``usp.models.sparse_mlp.SparseMlp``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.dim, cfg.n_experts, cfg.experts_per_token, cfg.expert_ffn_dim,
                         alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        self.tiles = cfg.mlp_tiles


class GptOss(Transformer):
    """The shared ``Transformer`` with a ``GptOssSparseMlp`` as every block's MLP."""

    def make_block(self, cfg: ModelConfig, attn_fn: AttnFn, layer: int) -> Block:
        return Block(cfg, attn_fn, cfg.layer_window(layer), mlp=GptOssSparseMlp(cfg))
