"""Per-rank memory of one training step: what ``usp.train`` holds on the busiest ulysses
rank, term by term, from the tensors the code allocates.

The run: the built-in ``usp.models.decoder.Transformer``, FSDP2 over all ``W = dp x ring x ulysses``
ranks, AdamW, ``B`` sequences per dp rank in one forward. Per rank: ``T = L/P`` tokens,
``S = L/r`` tokens of a ring segment, ``h``/``kv`` the query/KV heads the busiest ulysses
rank attends with (``head_split``), ``d`` head_dim, ``D`` dim, ``F`` ffn_dim, ``V`` vocab,
``a`` bytes of the compute dtype (``trainer.dtype``), ``N`` parameters. Bytes below are for
one sequence unless they say ``B``; layers are counted one by one.

Terms of ``MemorySplit`` (each is its own largest size over the step):

- ``state``: parameters, gradients and AdamW m, v, sharded in fp32 (``16 N / W``; the
  gradients exist from backward to the optimizer step). Gathered in the compute dtype: the
  root module (embedding, final norm, LM head) from forward to the end of backward (FSDP2
  keeps the root unsharded after forward) and two blocks (the current one and the
  prefetched one); in backward also one block's unsharded gradients (``a``, plus the fp32
  copy reduce-scatter sends when ``a < 4``) and the root's. At the embedding's backward
  (the last op of backward): the root gathered and its unsharded gradients (``2 a root``),
  the blocks' gradients sharded, one block gathered; tied embeddings add ``2 a V D`` (the
  LM head's and the lookup's gradients of the one weight and their sum are live at once).
  Without ``fsdp``: ``16 N`` (+ ``2 a V D`` tied). ``state_offload``: the sharded ``16 N / W``
  is in host memory; the device keeps the gathered and unsharded parts (``offload``).
- ``activations``: what autograd holds at the end of forward (``activations.layer_bytes``).
  Per token of a layer: each RMSNorm recomputes its fp32 work in backward
  (``usp.models.decoder.RMSNorm``) and keeps its input and output (``2 a D``); attention
  keeps the o-projection input (``a Hq d``), the q/k norms' inputs with ``qk_norm``, and
  per segment token the ring's q, k, v, out (``a``) and LSE (fp32) in head layout; RoPE
  keeps only its tables; the MLP its gate, SiLU, up and product (``4 a F``; none with
  ``mlp_tiles > 1``, whose tiles are recomputed). A checkpointed block keeps its input
  (``a D``) instead of the part it recomputes (``block``: all; ``attention``: norm + qkv +
  attention + wo; ``mlp``: norm + MLP). ``offload`` (CUDA) moves those inputs to host
  memory; two stay on the device (the block in backward and the one prefetched or in
  flight). Plus RoPE tables and the final norm's input and output.
- ``attention``: the attention sub-layer's work beyond what it saves, the largest of the
  call's forward and backward buffers (``attention_buffers``, the ulysses all-to-all's
  token-layout q, k, v included), RoPE's (q, k, v in token layout and three fp32 copies of
  the query heads, forward or backward) and a norm's backward (six fp32 values a channel,
  measured 24 bytes, beside its input).
- ``mlp``: MLP intermediates beyond what it saves: forward of a tile (``4 a F`` per tile
  token), backward (two more ``a F`` gradients beside the four saved, or the tile's six).
- ``logits``: LM head + loss. Whole (``loss_chunk=0``, ``usp.models.tiling.lm_loss``): in
  backward the fp32 log-probabilities, their gradient and the logits' gradient
  (``12 B T V``; forward holds at most ``(a + 8) B T V``). Chunked
  (``usp.models.tiling.chunked_lm_loss``, ``c`` tokens a chunk): backward holds dh (``a B T
  D``) and the fp32 dW accumulator (``4 V D``) throughout, and at its largest either a
  chunk's fp32 logits and softmax (``8 c V``; forward's peak too) or its gradient in the
  compute dtype with that chunk's dW, and on CPU below fp32 the fp32 copy the accumulating
  add makes of it inside the op (``a c V + V D (a + 4)``; else ``a c V + a V D``).
- ``total``: the peak, the largest sum at one moment (so ``total <= `` the sum of terms):
  the last layer's attention and MLP forward, the loss, and each layer's backward of its
  MLP, MLP norm, attention, RoPE and attention norm (recomputed when checkpointed; with
  the flowing gradients of the residual stream and the branch, ``2 a D``;
  ``activations.backward_moments``); ``peak_at`` names it.

Forward only (``forward_only=True``: usp-eval's scoring, no gradients, no optimizer state,
nothing saved for backward): ``state`` is the weights alone (``a N`` unsharded, as usp-eval
holds the model on every rank; with ``fsdp``, the fp32 shards ``4 N / W`` plus the root and
two blocks gathered); ``activations`` the residual stream and RoPE tables only (a layer's
intermediates are freed as it runs; no checkpoint policy applies); ``attention`` and ``mlp``
their forward buffers; ``logits`` the forward of the loss (whole: ``(a + 8) B T V``; chunked:
one chunk's ``8 c V``); ``total`` the largest of a layer's attention, a layer's MLP and the loss.

A mixture of experts (``experts``): a sparse layer's MLP saves its router logits and their
fp32 softmax, the routed copies and the experts' intermediates (``experts.mlp_memory``, tiled by
``mlp_tiles`` as a dense MLP), its work adds the exchange's buffers; a block FSDP gathers holds
the rank's ``E/N`` experts of expert degree N (``gathered_blocks``).

Counted on CUDA: the flash kernels' backward workspace per call (an fp32 dq accumulator,
GQA-expanded dK/dV: ``usp.dims.work.call_bytes``, for the head group the call takes). Not
counted: per-thread kernel tiles (the CPU flash kernel and flash-attn hold
``O(threads x tile^2)``), the data batch, allocator fragmentation, a2a_chunks stages
(the unpipelined call is counted, an upper bound on their buffers), masks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import ModelConfig
from ..dims.heads import check_heads, head_split
from .activations import FP32, attention_buffers, backward_moments, layer_bytes
from .experts import mlp_memory, rank_mlp_params
from .offload import device_state_bytes

ADAM_STATE = 16  # bytes/param sharded: fp32 parameter, fp32 gradient, Adam m and v
PARTS = ("block", "attention", "mlp")
TERMS = ("state", "activations", "attention", "mlp", "logits")


@dataclass(frozen=True)
class CheckpointPolicy:
    """Activation checkpointing as ``trainer`` sets it: blocks 0, k, 2k, ... (``every``)
    recompute ``part`` in backward; ``offload`` parks their inputs in host memory;
    ``state_offload`` the sharded state (``usp.planner.offload``)."""

    enabled: bool = False
    every: int = 1
    part: str = "block"
    offload: bool = False
    state_offload: bool = False

    def __post_init__(self) -> None:
        if self.every < 1 or self.part not in PARTS or (self.offload and not self.enabled):
            raise ValueError(f"CheckpointPolicy(enabled={self.enabled}, every={self.every}, "
                             f"part={self.part!r}, offload={self.offload}) needs every >= 1, "
                             f"part in {PARTS}, and offload only with enabled=True")

    @classmethod
    def from_trainer(cls, trainer) -> "CheckpointPolicy":
        """The policy of a ``TrainerConfig``."""
        return cls(trainer.activation_checkpointing, trainer.checkpoint_every,
                   trainer.checkpoint_part, trainer.activation_offload, trainer.state_offload)

    def checkpointed(self, layer: int) -> bool:
        return self.enabled and layer % self.every == 0


@dataclass(frozen=True)
class MemorySplit:
    """Bytes per rank (the busiest ulysses rank) for one step; see the module docstring."""

    state: float
    activations: float
    attention: float
    mlp: float
    logits: float
    total: float
    peak_at: str  # the moment of the peak, e.g. "backward of layer 31's attention"

    @property
    def dominant(self) -> str:
        """The largest term's name."""
        return max(TERMS, key=lambda t: getattr(self, t))

    def terms(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "peak_at"}

    def line(self, budget: float | None = None) -> str:
        """``state 9.7 GiB | ... | total 28.2 GiB`` (``of <budget>`` when given)."""
        text = " | ".join(f"{k} {size(v)}" for k, v in self.terms().items())
        return text + ("" if budget is None else f" of {size(budget)}")


def size(nbytes: float) -> str:
    """Bytes as ``1.5 GiB`` or ``12.0 MiB``."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def gathered_blocks(model: ModelConfig, expert_degree: int = 1) -> tuple[float, float]:
    """(the largest block FSDP gathers on a rank, the root: embedding (+ LM head), final
    norm, and what else no block's matmuls hold). A block: its attention, its MLP (a sparse
    one: the router and the rank's ``E/N`` experts, ``experts.rank_mlp_params``) and its two
    norms."""
    m, D = model, model.dim
    att = m.attention_params() + 2 * D
    root = m.num_params() - sum(att + m.mlp_params(i) for i in range(m.n_layers))
    return att + max(rank_mlp_params(m, i, expert_degree) for i in range(m.n_layers)), root


def state_bytes(model: ModelConfig, world: int, dtype_bytes: int, fsdp: bool,
                expert_degree: int = 1, offload: bool = False) -> tuple[float, float, float]:
    """The ``state`` term at its three moments (module docstring): (forward, backward, the
    embedding's backward) bytes per rank of the training state of ``world`` ranks; a mixture
    of experts of ``expert_degree`` N gathers its rank's ``E/N`` experts of a block (the
    sharded state, ``E/N`` experts over ``W/N`` ranks, is the same at every N). ``offload``
    (FSDP only): the sharded state in host memory, ``offload.device_state_bytes``."""
    m, a = model, dtype_bytes
    low = FP32 if a < FP32 else 0  # the fp32 copy reduce-scatter sends below fp32
    n, V, D = m.num_params(), m.vocab_size, m.dim
    block, root = gathered_blocks(m, expert_degree)
    if offload and fsdp:
        tied = 2 * V * D * a if m.tie_embeddings else 0
        return device_state_bytes(block, root, world, a, tied)
    if not fsdp:
        state_f, state_b = ADAM_STATE * n - 4 * n, ADAM_STATE * n
        return state_f, state_b, state_b + (2 * V * D * a if m.tie_embeddings else 0)
    sharded = ADAM_STATE * n / world
    gathered = (root + 2 * block) * a
    state_f = sharded - 4 * n / world + gathered  # no gradients before backward
    state_b = sharded + gathered + block * (a + low) + root * a
    # the embedding's backward: the root gathered, its unsharded gradients, the blocks'
    # gradients already sharded, one block still gathered; tied, the embedding's two
    # gradients (LM head, lookup) and their sum are live at once
    emb = V * D
    state_e = ((ADAM_STATE - 4) * n / world + 4 * (n - root) / world + block * a
               + 2 * root * a + (2 * emb * a if m.tie_embeddings else 0))
    return state_f, state_b, state_e


def logits_bytes(model: ModelConfig, batch: int, tokens: float, dtype_bytes: int,
                 device: str = "cuda") -> float:
    """The ``logits`` term (module docstring) for ``batch`` sequences of ``tokens`` tokens
    on a rank: the loss over the whole logits, or in ``model.loss_chunk`` chunks."""
    B, T, a, V, D = batch, tokens, dtype_bytes, model.vocab_size, model.dim
    if not model.loss_chunk:
        return 12 * B * T * V
    # dW += a chunk's dW below fp32: CPU kernels cast it to an fp32 copy first, CUDA's in flight
    low = FP32 if a < FP32 and device == "cpu" else 0
    c = min(model.loss_chunk, B * T)
    return a * B * T * D + FP32 * V * D + max(8 * c * V, a * c * V + V * D * (a + low))


def forward_state_bytes(model: ModelConfig, world: int, dtype_bytes: int, fsdp: bool) -> float:
    """The forward-only ``state`` term (module docstring): the weights, no gradients and no
    optimizer state; unsharded in the compute dtype, or FSDP's fp32 shards plus the root
    and two blocks gathered."""
    m, a = model, dtype_bytes
    n = m.num_params()
    if not fsdp:
        return a * n
    block = m.layer_matmul_params() + 2 * m.dim
    return FP32 * n / world + (n - m.n_layers * block + 2 * block) * a


def forward_logits_bytes(model: ModelConfig, batch: int, tokens: float, dtype_bytes: int) -> float:
    """The forward-only ``logits`` term: the loss's forward over whole logits (the logits
    and their fp32 log-probabilities), or one ``model.loss_chunk`` chunk's fp32 logits and
    softmax."""
    B, T, V = batch, tokens, model.vocab_size
    if not model.loss_chunk:
        return (dtype_bytes + 8) * B * T * V
    return 8 * min(model.loss_chunk, B * T) * V


def _forward_split(model: ModelConfig, seq_len: int, dp: int, ring: int, ulysses: int,
                   batch: int, dtype_bytes: int, fsdp: bool, kernel: str,
                   device: str) -> MemorySplit:
    """``memory_split(..., forward_only=True)``: one forward pass, nothing kept for backward."""
    m, a, B, u, r = model, dtype_bytes, batch, ulysses, ring
    D, d, hq, hkv = m.dim, m.head_dim, m.n_heads, m.n_kv_heads
    check_heads(hq, hkv, u)
    T = seq_len / (r * u)
    state = forward_state_bytes(m, dp * r * u, a, fsdp)
    norm = (8 + a) * D * T  # an RMSNorm's fp32 copy, normalised and output
    stream = B * (a * D * T + T * d * FP32)  # the residual stream and the RoPE tables
    af, _ = attention_buffers(seq_len, r, u, hq, hkv, d, a, kernel, device)
    mlp = B * max(mlp_memory(m, i, T, a)[1] for i in range(m.n_layers))  # a tile's forward
    qkv = B * (norm + 4 * (hq + hkv) * d * T + a * hq * d * T)  # normed input, fp32 q/k, out
    logits = forward_logits_bytes(m, B, T, a)
    moments = {"forward of a layer's attention": state + stream + qkv + B * af,
               "forward of a layer's MLP": state + stream + B * norm + mlp,
               "loss": state + stream + logits}
    peak_at = max(moments, key=moments.get)
    return MemorySplit(state=state, activations=stream, attention=B * af, mlp=mlp,
                       logits=logits, total=moments[peak_at], peak_at=peak_at)


def memory_split(model: ModelConfig, seq_len: int, dp: int, ring: int, ulysses: int, *,
                 batch: int = 1, dtype_bytes: int = 2, fsdp: bool = True,
                 policy: CheckpointPolicy = CheckpointPolicy(), kernel: str = "torch",
                 device: str = "cuda", forward_only: bool = False,
                 expert_degree: int = 1) -> MemorySplit:
    """Memory of one step of ``batch`` sequences of ``seq_len`` tokens per dp rank on the
    busiest rank of ``dp x ring x ulysses``, in the module docstring's model. ``model``
    supplies ``loss_chunk`` and ``mlp_tiles``; ``policy`` the activation checkpointing.
    ``forward_only``: one forward pass with no gradients and no optimizer state (scoring;
    ``policy`` does not apply). ``expert_degree``: a mixture of experts' (``experts``; the
    forward-only memory holds every expert). Raises ``ValueError`` when the heads cannot split over
    ``ulysses``."""
    if min(dp, ring, ulysses, batch, seq_len) < 1:
        raise ValueError(f"memory_split needs positive dp, ring, ulysses, batch and seq_len; "
                         f"got dp={dp}, ring={ring}, ulysses={ulysses}, batch={batch}, "
                         f"seq_len={seq_len}")
    if forward_only:
        return _forward_split(model, seq_len, dp, ring, ulysses, batch, dtype_bytes, fsdp,
                              kernel, device)
    m, a, B = model, dtype_bytes, batch
    d, hq, hkv = m.head_dim, m.n_heads, m.n_kv_heads
    u, r = ulysses, ring
    kv, h = check_heads(hq, hkv, u), max(head_split(hq, hkv, u).q_counts)
    T, S = seq_len / (r * u), seq_len / r
    state_f, state_b, state_e = state_bytes(m, dp * r * u, a, fsdp, expert_degree,
                                            policy.state_offload)

    # ---- activations per layer (bytes per sequence, activations.layer_bytes) --------------
    lb = layer_bytes(m, T, S, h, kv, a)
    inp = lb.inp  # a block's input, what a checkpoint keeps
    # per layer (dense or sparse, experts.mlp_memory): (saved, forward work, backward work)
    mlps = [mlp_memory(m, i, T, a, expert_degree) for i in range(m.n_layers)]
    mlp_parts = [lb.norm + saved for saved, _, _ in mlps]
    keep_inp = 0.0 if policy.offload else inp  # an offloaded input leaves the device

    def resident(i: int) -> float:
        if not policy.checkpointed(i):
            return lb.attn + mlp_parts[i]
        return keep_inp + {"block": 0.0, "attention": mlp_parts[i],
                           "mlp": lb.attn}[policy.part]

    nl = m.n_layers
    res = [B * resident(i) for i in range(nl)]
    ckpts = [policy.checkpointed(i) for i in range(nl)]
    on_device = B * min(2, sum(ckpts)) * inp if policy.offload else 0.0  # in use + in flight
    common = B * (lb.tables + lb.final_norm) + on_device
    activations = sum(res) + common

    # ---- transient terms -----------------------------------------------------------------
    af, ab = attention_buffers(seq_len, r, u, hq, hkv, d, a, kernel, device)
    attention = B * max(af, ab, lb.rope, lb.norm_work)
    # a tile's work in forward (untiled: what it saves) and backward, the largest layer's
    mlp = B * max(b if m.mlp_tiles == 1 else max(f, b) for _, f, b in mlps)
    logits = logits_bytes(m, B, T, a, device)

    # ---- the peak: every moment of the step ------------------------------------------------
    moments: dict[str, float] = {}
    before_last = sum(res[:-1]) + common
    last_ckpt = ckpts[-1] and policy.part in ("block", "attention")
    last_attn = B * (keep_inp if last_ckpt else lb.attn)
    moments[f"forward of layer {nl - 1}'s attention"] = (
        state_f + before_last + B * (lb.norm + max(lb.rope, af)))
    moments[f"forward of layer {nl - 1}'s MLP"] = (
        state_f + before_last + last_attn + B * (lb.norm + mlps[-1][1]))
    moments["loss"] = state_f + activations + logits
    # in backward the final norm's tensors are gone and, offloaded, one input is prefetched
    # (the block being recomputed holds its own in its part)
    ahead = B * min(1, sum(ckpts) - 1) * inp if policy.offload else 0.0
    held = state_b + sum(res) + B * lb.tables + ahead
    moments.update(backward_moments(lb, held, res, mlps, ckpts, policy.part, B, ab))
    moments["backward of the embedding"] = state_e
    peak_at = max(moments, key=moments.get)
    state = max(state_f, state_b, state_e)
    return MemorySplit(state=state, activations=activations, attention=attention, mlp=mlp,
                       logits=logits, total=moments[peak_at], peak_at=peak_at)

