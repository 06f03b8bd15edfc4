"""A packed row of documents and the same documents run alone, on a small ``Transformer``
(``unit/test_packing.py``, ``distributed/test_packing_ranks.py``)."""

from __future__ import annotations

import functools

import torch

from usp.attention import local_attention

MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
LOCAL = functools.partial(local_attention, causal=True)


def packed_row(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    ids = torch.cat([torch.full((m,), d) for d, m in enumerate(lengths)])[None]  # [1, L]
    return tokens, ids


def documents_alone(model, tokens, ids):
    """Each document of the row run on its own, RoPE from 0: logits [1, L, V]."""
    parts = [model(tokens[:, ids[0] == d], torch.arange(int((ids[0] == d).sum())))
             for d in ids[0].unique()]
    return torch.cat(parts, dim=1)
