"""Per-token losses and predictions (scoring: usp.eval) against a plain full-logits
computation: the built-in model with and without ``model.loss_chunk``, and a transformers
model through ``usp.models.forward``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from usp.attention import local_attention
from usp.config import ModelConfig
from usp.data.packing import IGNORE_INDEX, Batch
from usp.models.decoder import Transformer
from usp.models.forward import forward, loss_and_predictions, token_losses_and_predictions

LOCAL = functools.partial(local_attention, causal=True)
CFG = dict(vocab_size=64, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32)


def _batch(vocab: int, b: int = 2, n: int = 12) -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    labels = torch.randint(0, vocab, (b, n), generator=g)
    labels[0, :3] = IGNORE_INDEX
    return Batch(tokens=tokens, labels=labels)


def _plain(logits: torch.Tensor, labels: torch.Tensor):
    """Each token's loss from whole fp32 logits, written out: -log softmax at the label."""
    logp = torch.log_softmax(logits.float(), -1)  # [B, n, V]
    keep = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, n]
    return torch.where(keep, -picked, torch.zeros_like(picked)), logits.argmax(-1)


@pytest.mark.parametrize("chunk", [0, 5])
def test_builtin_token_losses_match_full_logits(chunk):
    model = Transformer(ModelConfig(**CFG, loss_chunk=chunk), LOCAL).eval()
    batch = _batch(CFG["vocab_size"])
    pos = torch.arange(batch.tokens.shape[1])
    with torch.no_grad():
        logits = Transformer(ModelConfig(**CFG), LOCAL).eval()(batch.tokens, pos)
        losses, preds = token_losses_and_predictions(model, batch, pos)
        loss_sum, sum_preds = loss_and_predictions(model, batch, pos)
    want, want_preds = _plain(logits, batch.labels)
    assert losses.shape == batch.labels.shape and losses.dtype == torch.float32
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(preds, want_preds) and torch.equal(preds, sum_preds)
    torch.testing.assert_close(losses.sum(), loss_sum, rtol=1e-5, atol=1e-5)
    assert (losses[0, :3] == 0).all()


def test_transformers_token_losses_match_full_logits():
    pytest.importorskip("transformers")
    from tests._hf_tiny import tiny_model

    model = tiny_model("llama").eval()
    batch = _batch(model.config.vocab_size)
    pos = torch.arange(batch.tokens.shape[1])
    with torch.no_grad():
        losses, preds = token_losses_and_predictions(model, batch, pos)
        logits = forward(model, batch, pos)
    want, want_preds = _plain(logits, batch.labels)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(preds, want_preds)
    ref = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), reduction="sum")
    torch.testing.assert_close(losses.sum(), ref, rtol=1e-5, atol=1e-5)
