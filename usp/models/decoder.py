"""A Llama-style GQA decoder whose attention is a pluggable function.

RMSNorm, RoPE, SwiGLU, q/k/v biases only with ``cfg.qkv_bias`` (Qwen2) and an o_proj bias only
with ``cfg.o_bias`` (gpt-oss), an RMSNorm of each
q and k head before RoPE only with ``cfg.qk_norm`` (Qwen3), tied or untied embeddings,
``cfg.head_dim`` wide heads, a RoPE base of their own on the sliding layers with
``cfg.local_rope_theta``. Attention is whatever
``attn_fn(q, k, v, **options) -> out`` the caller passes (q [B, n, Hq, hd], k/v [B, n, Hkv,
hd], out [B, n, Hq, hd]; ``options``: ``segment_ids`` [B, n] when documents are packed,
``window`` on sliding-window layers and ``scale`` with ``cfg.query_pre_attn_scalar``, each
passed only when set; ``sinks`` [Hq], a learned logit per query head, with
``cfg.attention_sinks``), e.g.

- one process: ``functools.partial(usp.attention.local_attention, causal=True)``;
- sequence parallel: ``functools.partial(usp_attention, mesh=mesh, layout=layout,
  causal=True, kernel="torch")``, with ``tokens = layout.shard(global_tokens)`` and
  ``positions = layout.positions()``.

Everything except attention is token-wise, so under sequence parallelism the model sees
only this rank's ``n = L/P`` tokens; RoPE rotates them by their *global* positions (not
contiguous under zigzag), which is why ``forward`` takes ``positions``: [n] shared by the
batch, or [B, n] when each row has its own (positions restarting per packed document).
Layer ``i`` attends within ``cfg.sliding_window`` tokens when ``cfg.layer_window(i)`` says
so (every layer, all but every k-th: ``full_attention_every``, or per layer: ``layer_types``).
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..dims import work
from .offload import ActivationOffload
from .rope import apply_rope, rope_cos_sin
from .tiling import chunked_lm_loss, hidden_token_losses, lm_loss, tiled

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """x [..., D] -> x / rms(x) * gain, computed in fp32, returned in x.dtype; the gain is
    ``weight`` (a family's norm may derive it otherwise: ``gain``).

    With gradients on it is recomputed in backward (``recompute``, non-reentrant
    ``torch.utils.checkpoint``): autograd keeps x (``a`` bytes per channel) instead of its
    fp32 copy and the fp32 normalised values (8 bytes per channel); backward reruns the same
    ops on the same x, so the gradients are bit-identical. It nests inside a checkpointed
    block and an MLP tile as ``usp.models.tiling.tiled`` does. ``tiles`` > 1 (the block
    norms' and the final norm's ``model.norm_tiles``): over that many sequence tiles of
    x [B, n, D], each recomputed in backward on its own, so a backward holds one tile's
    fp32 work instead of the whole sequence's (the weight's gradient is then summed tile by
    tile: equal to the untiled one up to the order of that sum). Every norm (q/k norms too)
    takes more tiles than ``tiles`` while one tile's backward work would pass
    ``usp.dims.work.NORM_BYTES`` (``work.norm_tiles``: only at tens of thousands of tokens
    a rank).
    """

    recompute = True  # False: autograd keeps the fp32 intermediates (the tests' reference)
    tiles = 1  # sequence tiles (model.norm_tiles), set on the norms of the residual stream

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # nothing kept for a backward: no tiles, no recompute
            return self._normalise(x)
        # x [B, n, ...]: tiles over n, each tile's work sized per sequence row
        tiles = work.norm_tiles(self.tiles, x.shape[1], math.prod(x.shape[2:])) \
            if x.dim() > 2 else 1
        if tiles > 1:
            return tiled(self._normalise, x, tiles, dim=1)
        if self.recompute:
            return checkpoint(self._normalise, x, use_reentrant=False, preserve_rng_state=False)
        return self._normalise(x)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.gain()).to(x.dtype)

    def gain(self) -> torch.Tensor:
        """The factor [D] fp32 each normalised channel is multiplied by."""
        return self.weight.float()


class Attention(nn.Module):
    """GQA self-attention projections around ``attn_fn``: x [B, n, D] -> [B, n, D]. The
    scores are scaled by ``cfg.query_pre_attn_scalar ** -0.5`` when it is set (passed to
    ``attn_fn`` as ``scale``), else by ``attn_fn``'s default, ``head_dim ** -0.5``; the q/k
    norms (``cfg.qk_norm``) are of class ``norm``. With ``cfg.attention_sinks`` each query
    head's softmax has one more logit, ``sinks`` [Hq], that carries no value (gpt-oss's;
    passed to ``attn_fn`` as ``sinks``)."""

    def __init__(self, cfg: ModelConfig, attn_fn: AttnFn, window: int | None = None,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = window  # sliding window of this layer (None: full attention)
        bias = cfg.qkv_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.attention_sinks else None
        # one weight [hd] shared by all heads of q, one by all of k (Qwen3's q_norm, k_norm)
        self.q_norm = norm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        scalar = cfg.query_pre_attn_scalar
        self.scale = None if scalar is None else scalar ** -0.5
        self.attn_fn = attn_fn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim)  # [B, n, D] -> [B, n, Hq, hd]
        k = self.wk(x).view(b, n, self.n_kv_heads, self.head_dim)  # -> [B, n, Hkv, hd]
        v = self.wv(x).view(b, n, self.n_kv_heads, self.head_dim)  # -> [B, n, Hkv, hd]
        if self.q_norm is not None:  # over hd, head by head: here every head of this rank's
            # tokens is whole, before attn_fn moves heads between ranks (Ulysses)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        options = {}  # only those set: a model needing none calls attn_fn(q, k, v)
        if segment_ids is not None:
            options["segment_ids"] = segment_ids
        if self.window is not None:
            options["window"] = self.window
        if self.scale is not None:
            options["scale"] = self.scale
        if self.sinks is not None:
            options["sinks"] = self.sinks  # [Hq], every head's: attn_fn picks a rank's own
        out = self.attn_fn(q, k, v, **options)  # [B, n, Hq, hd]
        return self.wo(out.reshape(b, n, self.n_heads * self.head_dim))  # -> [B, n, D]


class FeedForward(nn.Module):
    """Gated MLP: x [B, n, D] -> w2(act(w1 x) * w3 x) [B, n, D], SwiGLU with ``act`` silu
    (GeGLU with a GELU); over ``tiles`` sequence tiles recomputed in backward when ``tiles >
    1`` (``usp.models.tiling.tiled``: one tile's [B, n/tiles, F] intermediates at a time)."""

    def __init__(self, dim: int, ffn_dim: int, tiles: int = 1,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down
        self.tiles = tiles
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(self._gated, x, self.tiles)

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


RECOMPUTE_PARTS = ("block", "attention", "mlp")


class Block(nn.Module):
    """Pre-norm decoder block: h + attn(norm(h)), then + ffn(norm(.)); [B, n, D] -> [B, n, D].

    ``recompute`` (set by ``Transformer``): None, or the part whose activations backward
    recomputes (``block``; ``attention``: norm + qkv + attention + wo; ``mlp``: norm + w1/w3/w2).
    ``offload``: an ``ActivationOffload`` that parks the recomputed part's input on the host.
    A family's block may change the parts (``_attention``, ``_mlp``), its norms (``norm``),
    the MLP's activation (``act``) or the MLP itself (``mlp``: a module in place of the
    ``FeedForward`` of ``cfg.ffn_dim``).
    """

    def __init__(self, cfg: ModelConfig, attn_fn: AttnFn, window: int | None = None,
                 norm: type[RMSNorm] = RMSNorm,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.attention_norm = norm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, attn_fn, window, norm)
        self.ffn_norm = norm(cfg.dim, cfg.norm_eps)
        self.feed_forward = mlp if mlp is not None else \
            FeedForward(cfg.dim, cfg.ffn_dim, cfg.mlp_tiles, act)
        self.attention_norm.tiles = self.ffn_norm.tiles = cfg.norm_tiles
        self.recompute: str | None = None
        self.offload: ActivationOffload | None = None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        part = self.recompute if torch.is_grad_enabled() else None
        if part == "block":
            return self._checkpoint(self._block, h, cos, sin, segment_ids)
        if part == "attention":
            h = h + self._checkpoint(self._attention, h, cos, sin, segment_ids)
        else:
            h = h + self._attention(h, cos, sin, segment_ids)
        if part == "mlp":
            return h + self._checkpoint(self._mlp, h)
        return h + self._mlp(h)

    def _checkpoint(self, fn, x: torch.Tensor, *args) -> torch.Tensor:
        if self.offload is not None:
            return self.offload.checkpoint(fn, x, *args)
        return checkpoint(fn, x, *args, use_reentrant=False)

    def _block(self, h, cos, sin, segment_ids):
        h = h + self._attention(h, cos, sin, segment_ids)
        return h + self._mlp(h)

    def _attention(self, h, cos, sin, segment_ids):
        return self.attention(self.attention_norm(h), cos, sin, segment_ids)

    def _mlp(self, h):
        return self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only LM: ``forward(tokens [B, n], positions [n] | [B, n], segment_ids [B, n]
    | None) -> logits [B, n, V]``, or with ``labels`` [B, n] -> (loss_sum, predictions).

    ``self.layers`` is an ``nn.ModuleList`` of ``Block`` so a trainer can wrap each block
    (FSDP2 ``fully_shard``). With ``checkpoint_activations`` blocks 0, k, 2k, ... (k =
    ``checkpoint_every``) recompute ``checkpoint_part`` (``block``, ``attention`` or
    ``mlp``) in backward (``torch.utils.checkpoint``, non-reentrant); ``offload`` (an
    ``usp.models.offload.ActivationOffload``) parks what those checkpoints keep on the host.
    ``cfg.mlp_tiles`` tiles every MLP over the sequence, ``cfg.loss_chunk`` the LM head and
    loss (``usp.models.tiling``). The weights are initialised by ``init_weights(0)`` at
    construction; call ``init_weights(seed)`` again (before sharding) for another seed.
    Each layer rotates by its own RoPE (``cfg.layer_rope``: the sliding layers' base may
    differ). A family's model may change the blocks (``block``, or layer by layer
    ``make_block``), the final norm (``final_norm``) and the embedding (``embed``).
    """

    block: type[Block] = Block
    final_norm: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, attn_fn: AttnFn, checkpoint_activations: bool = False,
                 checkpoint_every: int = 1, checkpoint_part: str = "block",
                 offload: ActivationOffload | None = None):
        super().__init__()
        if checkpoint_every < 1 or checkpoint_part not in RECOMPUTE_PARTS:
            raise ValueError(f"checkpoint_every={checkpoint_every} checkpoint_part="
                             f"{checkpoint_part!r}: use checkpoint_every >= 1 and a part in "
                             f"{RECOMPUTE_PARTS}")
        if offload is not None and not checkpoint_activations:
            raise ValueError("offload parks the inputs activation checkpoints keep; pass "
                             "checkpoint_activations=True with it")
        self.cfg = cfg
        self.offload = offload
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.make_block(cfg, attn_fn, i) for i in range(cfg.n_layers))
        for i, block in enumerate(self.layers):
            if checkpoint_activations and i % checkpoint_every == 0:
                block.recompute, block.offload = checkpoint_part, offload
        self.norm = self.final_norm(cfg.dim, cfg.norm_eps)
        self.norm.tiles = cfg.norm_tiles
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.init_weights(0)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init that depends only on ``seed`` and each parameter's name.

        Each parameter draws from its own CPU generator seeded by (seed, crc32(name)), so
        the result does not depend on device, parameter order or the parallel layout.
        Matrices ~ N(0, 0.02); the projections that write into the residual stream
        (``attention.wo``, ``feed_forward.w2``) ~ N(0, 0.02 / sqrt(2 * n_layers));
        RMSNorm weights = 1, biases = 0 (gpt-oss's expert biases too), anything else (the
        sinks) ~ N(0, 0.02).
        """
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", ".bias", "_proj_bias")):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                segment_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                per_token: bool = False, weights: torch.Tensor | None = None):
        """tokens [B, n] long; positions [n] or [B, n] long (the RoPE positions of these
        tokens); segment_ids [B, n] long or None (packed documents: a token attends only
        within its document) -> logits [B, n, V] in the parameter dtype.

        With labels [B, n] long (-100: not counted) -> (loss_sum, predictions): the summed
        cross-entropy in fp32 (0-dim) and each token's argmax [B, n] long. With
        ``cfg.loss_chunk`` the logits are made ``loss_chunk`` tokens at a time and never
        whole (``usp.models.tiling.chunked_lm_loss``); the head weight is used here, inside the
        root module, so a root FSDP wrap has it gathered. ``per_token`` (with labels, no
        gradients): each token's loss [B, n] instead of the sum
        (``usp.models.tiling.hidden_token_losses``, chunked as the loss is). ``weights``
        [B, n] (with labels): each token's loss weight in the sum (``trainer.loss_norm``).
        """
        b, n = tokens.shape if tokens.dim() == 2 else (None, None)
        if n is None or positions.shape not in ((n,), (b, n)):
            raise ValueError(
                f"expected tokens [B, n] and positions [n] or [B, n], got tokens "
                f"{tuple(tokens.shape)} and positions {tuple(positions.shape)}"
            )
        for name, t in (("segment_ids", segment_ids), ("labels", labels)):
            if t is not None and t.shape != tokens.shape:
                raise ValueError(f"{name} {tuple(t.shape)} must match tokens "
                                 f"{tuple(tokens.shape)}: one per token")
        if self.offload is not None and torch.is_grad_enabled():
            self.offload.begin()
        h = self.embed(tokens)  # [B, n] -> [B, n, D]
        for layer, (cos, sin) in zip(self.layers, self._rope_tables(positions)):
            h = layer(h, cos, sin, segment_ids)
        h = self.norm(h)
        head = self.tok_embeddings.weight if self.output is None else self.output.weight  # [V, D]
        if labels is not None and per_token:
            return hidden_token_losses(h, head, labels, self.cfg.loss_chunk)
        if labels is not None and self.cfg.loss_chunk > 0:
            return chunked_lm_loss(h, head, labels, self.cfg.loss_chunk, weights)
        logits = F.linear(h, head)  # [B, n, D] -> [B, n, V]
        return logits if labels is None else lm_loss(logits, labels, weights)

    def make_block(self, cfg: ModelConfig, attn_fn: AttnFn, layer: int) -> Block:
        """Layer ``layer``'s block: a ``block`` with the layer's window."""
        return self.block(cfg, attn_fn, cfg.layer_window(layer))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, n] long -> the first hidden states [B, n, D]."""
        return self.tok_embeddings(tokens)

    def _rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) [*, n, hd/2] (``cfg.layer_rope``), each distinct RoPE
        computed once (one table, or one per layer type)."""
        tables, out = {}, []
        for i in range(self.cfg.n_layers):
            theta, scaling = self.cfg.layer_rope(i)
            key = (theta, tuple(sorted((scaling or {}).items())))
            if key not in tables:
                tables[key] = rope_cos_sin(positions, self.cfg.head_dim, theta, scaling)
            out.append(tables[key])
        return out

    def num_params(self) -> int:
        """Parameters actually held (tied embeddings counted once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token at ``seq_len`` (see module-level ``flops_per_token``)."""
        return flops_per_token(self.cfg, seq_len, causal)


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Model training FLOPs per token (forward + backward = 3 x forward), for MFU.

    - Matmuls with weights: 2 FLOPs per multiply-add, so ``6 * N_mm`` per token, where
      ``N_mm`` = per layer ``D*Hq*hd + 2*D*Hkv*hd + Hq*hd*D + 3*D*F`` (a sparse layer:
      ``D*E + 3*D*F_e*k`` for its router and the k experts a token runs) plus the output
      projection ``V*D`` (counted whether or not it is tied; the embedding lookup,
      RMSNorm, RoPE, SiLU and softmax are elementwise and left out).
    - Attention scores and mixing: QK^T and PV cost ``2 * Hq*hd`` FLOPs each per
      (query, key) pair, i.e. ``4*Hq*hd`` forward, ``12*Hq*hd`` for training. Non-causal,
      every query sees ``seq_len`` keys; causal, query t sees t+1 keys, averaging
      ``(seq_len + 1) / 2`` (the causal halving). So per layer ``12*Hq*hd*seq_len``
      (non-causal) or ``6*Hq*hd*(seq_len + 1)`` (causal).

    Recomputation (activation checkpointing, flash backward) is not counted: this is
    "model FLOPs", the numerator of MFU.
    """
    d, hd = cfg.dim, cfg.head_dim
    n_mm = cfg.matmul_params() + cfg.vocab_size * d  # a sparse layer: the experts it runs
    keys_per_query = (seq_len + 1) / 2 if causal else float(seq_len)
    attn = cfg.n_layers * 12 * cfg.n_heads * hd * keys_per_query
    return 6.0 * n_mm + attn
