"""``model.loss_chunk=auto``, ``model.mlp_tiles=auto`` and ``model.norm_tiles=auto``: the
planner sizes the tilings for one layout and length, as it picks the parallel degrees.

The rule, one per key, each against ``TILE_SHARE`` of the device budget (``StepPolicy.budget``:
``mem_fraction`` of the cluster spec's ``mem_bytes``; on a CPU run the spec's, as for the
degrees):

- ``loss_chunk``: the largest chunk (a power of two from ``MIN_CHUNK`` up to the first one
  that holds a rank's ``B x T`` tokens whole) whose ``logits`` term (``memory.logits_bytes``)
  is at most the share; none under it: ``MIN_CHUNK`` (the term's floor, the LM head's
  gradients and ``dh``, does not shrink with the chunk). Larger chunks run fewer, larger
  matmuls.
- ``mlp_tiles``: the fewest tiles (1, 2, 4, ..., at most ``MAX_TILES`` and a rank's tokens)
  whose MLP memory is at most the share; none under it: the most. The MLP memory of a count:
  one layer's MLP at its largest (what it saves and its work, ``experts.mlp_memory``) plus
  what the layers that do not recompute their MLP save until backward (none once tiled); an
  upper bound by one layer's saved intermediates when layers are not checkpointed.
- ``norm_tiles``: the fewest tiles (counted as ``mlp_tiles``) whose norm backward work
  (``activations.norm_work_bytes``: six fp32 values a channel of a tile) is at most the
  share; none under it: the most.

``tile_note`` is the start line that says what was picked (``usp: ...``), usp-plan's too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from ..config import ModelConfig
from .activations import norm_work_bytes
from .experts import mlp_memory
from .memory import CheckpointPolicy, forward_logits_bytes, logits_bytes, size

TILE_SHARE = 1 / 8  # each of the logits and the MLP memory: at most this share of the budget
MIN_CHUNK = 1024  # tokens: smaller chunks leave the LM head's matmul too thin to run fast
MAX_TILES = 1024
NO_CHECKPOINT = CheckpointPolicy()


@dataclass(frozen=True)
class TileChoice:
    """What ``size_tiles`` picked for one layout and length: ``model`` with ``loss_chunk`` and
    ``mlp_tiles`` set, the two terms at those values and the share's bytes they were held
    under."""

    model: ModelConfig
    logits: float
    mlp: float
    limit: float
    norms: float = 0.0  # a norm's backward work at the chosen norm_tiles


def mlp_bytes(model: ModelConfig, tokens: float, batch: int, dtype_bytes: int,
              policy: CheckpointPolicy | None, expert_degree: int = 1) -> float:
    """The MLP memory ``model`` (its ``mlp_tiles``) holds on a rank for ``batch`` sequences
    of ``tokens`` tokens (module docstring); ``policy`` None: a forward pass alone (a tile's
    forward work, nothing saved)."""
    parts = [mlp_memory(model, i, tokens, dtype_bytes, expert_degree)
             for i in range(model.n_layers)]
    if policy is None:
        return batch * max(f for _, f, _ in parts)
    one = max(saved + max(f, b) for saved, f, b in parts)
    kept = sum(saved for i, (saved, _, _) in enumerate(parts)  # saved until backward
               if not policy.checkpointed(i) or policy.part == "attention")
    return batch * (one + kept)


def _chunks(rows: float) -> list[int]:
    """Chunk sizes tried, largest first: powers of two from ``MIN_CHUNK`` to the first that
    holds ``rows`` tokens."""
    out = [MIN_CHUNK]
    while out[-1] < rows:
        out.append(2 * out[-1])
    return out[::-1]


def _tile_counts(tokens: float) -> list[int]:
    """Tile counts tried, fewest first: 1, 2, 4, ... up to ``MAX_TILES`` and ``tokens``."""
    out = [1]
    while 2 * out[-1] <= min(MAX_TILES, tokens):
        out.append(2 * out[-1])
    return out


def _first_under(values: list[int], fallback: int, limit: float, term) -> int:
    """The first of ``values`` (in the key's order of preference) whose ``term`` is at most
    ``limit``; ``fallback`` when none is."""
    return next((v for v in values if term(v) <= limit), fallback)


def size_tiles(model: ModelConfig, seq_len: int, ring: int, ulysses: int, budget: float, *,
               batch: int = 1, dtype_bytes: int = 2,
               policy: CheckpointPolicy = NO_CHECKPOINT, expert_degree: int = 1,
               forward_only: bool = False, device: str = "cuda") -> TileChoice:
    """``model`` with its ``auto`` ``loss_chunk``/``mlp_tiles``/``norm_tiles`` sized (module
    docstring) for ``batch`` sequences of ``seq_len`` tokens on ``ring x ulysses``, against
    ``budget`` bytes a rank; keys already set are kept. ``forward_only``: usp-eval's pass
    (the logits term is one chunk's forward, nothing saved for backward)."""
    tokens = seq_len / (ring * ulysses)
    limit = TILE_SHARE * budget
    term = forward_logits_bytes if forward_only else partial(logits_bytes, device=device)
    held = None if forward_only else policy  # a forward pass saves nothing for backward
    m = model
    if m.loss_chunk == "auto":
        m = replace(m, loss_chunk=_first_under(
            _chunks(batch * tokens), MIN_CHUNK, limit,
            lambda c: term(replace(m, loss_chunk=c), batch, tokens, dtype_bytes)))
    counts = _tile_counts(tokens)
    if m.mlp_tiles == "auto":
        m = replace(m, mlp_tiles=_first_under(
            counts, counts[-1], limit,
            lambda k: mlp_bytes(replace(m, mlp_tiles=k), tokens, batch, dtype_bytes, held,
                                expert_degree)))
    if m.norm_tiles == "auto":
        m = replace(m, norm_tiles=_first_under(
            counts, counts[-1], limit,
            lambda k: batch * norm_work_bytes(replace(m, norm_tiles=k), tokens)))
    return TileChoice(m, term(m, batch, tokens, dtype_bytes),
                      mlp_bytes(m, tokens, batch, dtype_bytes, held, expert_degree), limit,
                      batch * norm_work_bytes(m, tokens))


def tile_note(asked: ModelConfig, choice: TileChoice) -> str | None:
    """The line that says what ``auto`` picked, e.g. ``model.loss_chunk=auto -> 4096,
    model.mlp_tiles=auto -> 8 (logits 6.1 GiB, MLP 1.2 GiB, each held under 1/8 of the
    budget: 9.0 GiB)``; None when neither key was ``auto``."""
    picked = [f"model.{k}=auto -> {getattr(choice.model, k)}" for k in asked.planned]
    if not picked:
        return None
    terms = [("logits", choice.logits), ("MLP", choice.mlp)]
    if "norm_tiles" in asked.planned:
        terms.append(("a norm's backward", choice.norms))
    over = [name for name, v in terms if v > choice.limit]
    tail = f"; {' and '.join(over)} over it even so" if over else ""
    held = ", ".join(f"{name} {size(v)}" for name, v in terms)
    return (f"{', '.join(picked)} ({held}, each held under 1/{round(1 / TILE_SHARE)} of the "
            f"budget: {size(choice.limit)}{tail})")
