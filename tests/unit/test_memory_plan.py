"""The planner's memory model (usp.planner.memory): each feature moves exactly its term by
the amount the shapes give; max_seq_len is the largest fitting length; usp-plan prints
the split; the planner prices batch_per_dp_rank on every dp as the trainer does."""

from __future__ import annotations

import dataclasses
import functools
import io
from contextlib import redirect_stdout

import pytest
import torch
from hydra import compose, initialize_config_dir

from usp import cli
from usp.config import ModelConfig
from usp.planner import CheckpointPolicy, max_seq_len, memory_split
from usp.planner.memory import attention_buffers
from usp.rules import seq_multiple

M = ModelConfig(vocab_size=32000, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768)
L, DP, R, U, B = 8192, 1, 2, 2, 2
T = L // (R * U)


def split(model=M, seq_len=L, **kw):
    kw.setdefault("batch", B)
    kw.setdefault("dtype_bytes", 4)
    return memory_split(model, seq_len, DP, R, U, **kw)


def _others(a, b, but):
    return {k: v for k, v in a.terms().items() if k not in (but, "total")} == \
        {k: v for k, v in b.terms().items() if k not in (but, "total")}


def test_loss_chunk_changes_only_the_logits_term_by_one_chunk():
    whole = split()
    assert whole.logits == 12 * B * T * M.vocab_size * 1.0  # fp32 logp, its grad, logits' grad
    assert split(seq_len=2 * L).logits == 2 * whole.logits
    c1, c2 = (split(dataclasses.replace(M, loss_chunk=c)) for c in (1024, 2048))
    assert _others(whole, c1, "logits") and _others(c1, c2, "logits")
    assert c2.logits - c1.logits == 8 * 1024 * M.vocab_size  # fp32 logits + softmax per token
    longer = split(dataclasses.replace(M, loss_chunk=1024), seq_len=2 * L)
    assert longer.logits - c1.logits == 4 * B * T * M.dim  # only dh grows with the sequence
    assert c1.logits < whole.logits / 4


def test_checkpoint_every_and_parts_keep_what_they_should():
    none = split().activations
    every1 = split(policy=CheckpointPolicy(True)).activations
    every2 = split(policy=CheckpointPolicy(True, every=2)).activations
    assert every2 - every1 == pytest.approx((none - every1) / 2)  # half the layers keep all
    att = split(policy=CheckpointPolicy(True, part="attention")).activations
    mlp = split(policy=CheckpointPolicy(True, part="mlp")).activations
    inp = 4 * B * T * M.dim  # a block's input, fp32: both parts keep it
    assert att + mlp == pytest.approx(none + every1 + M.n_layers * inp)  # parts split the block
    assert every1 < att < none and every1 < mlp < none


def test_offload_moves_checkpointed_inputs_off_the_device():
    kept = split(policy=CheckpointPolicy(True))
    off = split(policy=CheckpointPolicy(True, offload=True))
    inp = 4 * B * T * M.dim  # one block input, fp32
    assert kept.activations - off.activations == (M.n_layers - 2) * inp  # two stay on device
    assert _others(kept, off, "activations")


def test_mlp_tiles_drop_the_saved_intermediates():
    plain, tiled = split(), split(dataclasses.replace(M, mlp_tiles=4))
    assert plain.activations - tiled.activations == M.n_layers * 4 * 4 * B * T * M.ffn_dim
    assert tiled.mlp == 6 * 4 * B * (T // 4) * M.ffn_dim  # one tile recomputed in backward
    assert plain.mlp == 2 * 4 * B * T * M.ffn_dim
    assert (plain.state, plain.attention, plain.logits) == (tiled.state, tiled.attention,
                                                           tiled.logits)


def test_state_and_peak():
    a, b = split(), memory_split(M, L, 4, R, U, batch=B, dtype_bytes=4)
    assert a.state > b.state and split(seq_len=2 * L).state == a.state
    s = split(dataclasses.replace(M, loss_chunk=512))
    assert s.total <= sum(v for k, v in s.terms().items() if k != "total")
    assert split().peak_at == "loss" and split().dominant == "logits"


def test_short_sequences_peak_at_the_embedding_backward_whatever_the_length():
    # the root's gathered weight and gradients outweigh a few tokens' activations
    short, shorter = split(seq_len=64, batch=1), split(seq_len=32, batch=1)
    assert short.peak_at == shorter.peak_at == "backward of the embedding"
    assert short.total == shorter.total and short.state == short.total
    # tied: the gathered weight, its LM-head and lookup gradients and their sum, all fp32
    assert M.tie_embeddings and short.state > 4 * M.vocab_size * M.dim * 4


def test_attention_buffers_depend_on_the_kernel():
    args = (L, R, U, M.n_heads, M.n_kv_heads, M.head_dim)
    flash = attention_buffers(*args, 4, "torch", "cpu")
    # the flash kernels on CUDA (bf16): copies of the call's q, dout, out, k, v, their fp32
    # dq accumulator and row sums, and dK/dV expanded to the query heads (one call at this
    # length: usp.dims.work)
    cpu16, cuda16 = (attention_buffers(*args, 2, k, dev)
                     for k, dev in (("torch", "cpu"), ("flash_attn", "cuda")))
    S, h, kv, d = L / R, M.n_heads / U, M.n_kv_heads / U, M.head_dim
    assert cuda16[0] == cpu16[0] and attention_buffers(*args, 2, "torch", "cuda") == cuda16
    copies = 3 * S * h * d * 2 + 2 * S * kv * d * 2
    assert cuda16[1] - cpu16[1] == copies + S * h * (d + 1) * 4 + 2 * S * h * d * 2
    efficient = attention_buffers(*args, 4, "torch", "cuda")  # K/V expanded to query heads
    assert efficient[0] - flash[0] == 2 * (L / R) * (M.n_heads / U) * M.head_dim * 4
    ref = attention_buffers(*args, 4, "reference", "cpu")
    assert ref[1] - flash[1] == 5 * (L / R) ** 2 * (M.n_heads / U) * 4  # [S, S] scores
    with pytest.raises(ValueError, match="kernel must be one of"):
        attention_buffers(*args, 4, "tri")


def test_max_seq_len_is_the_largest_that_fits():
    budget = 3 * 2**30
    kw = dict(batch=1, dtype_bytes=4)
    longest = max_seq_len(M, budget, DP, R, U, **kw)
    step = seq_multiple(U, R, "zigzag")
    assert longest % step == 0 and longest > 0
    assert memory_split(M, longest, DP, R, U, **kw).total <= budget
    assert memory_split(M, longest + step, DP, R, U, **kw).total > budget
    assert max_seq_len(M, 1.0, DP, R, U, **kw) == 0


def _compose(overrides):
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        return cli.to_config(compose("plan", overrides=list(overrides)))


def test_usp_plan_prints_the_split_and_the_recipe_gains():
    cfg = _compose(["recipe=llama3_8b_1m_auto_h100x32"])
    assert cfg.model.loss_chunk > 0
    out = io.StringIO()
    with redirect_stdout(out):
        cli._plan(cfg)
    text = out.getvalue()
    assert "memory per rank (ulysses 8 x ring 4 x dp 1), peak at" in text
    for term in ("state", "activations", "attention", "mlp", "logits", "total"):
        assert f"{term} " in text.split("memory per rank")[1]
    chunked = int(text.split("longest seq_len that fits this layout: ")[1].split()[0])
    from usp.planner.report import plan_run

    spec = cfg.cluster
    whole = plan_run(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, loss_chunk=0)),
                     spec, spec.world)
    c = whole.find(1, 4, 8)
    best = plan_run(cfg, spec, spec.world).find(1, 4, 8)
    assert best.memory.logits < c.memory.logits / 3 and best.memory.total < c.memory.total
    assert chunked > 2 * int(whole.memory_text(c).split("layout: ")[1].split()[0])


@pytest.mark.parametrize("dp", [None, 2])
def test_planner_batch_is_per_dp_rank_like_the_trainer(dp):
    from usp.planner.report import plan_run

    cfg = _compose(["model=llama3_8b", "cluster=h100_ib", "nodes=4", "data.seq_len=131072",
                    "data.batch_per_dp_rank=3", "model.loss_chunk=4096",
                    f"parallel.dp_degree={'null' if dp is None else dp}"])
    spec = cfg.cluster.replace(nodes=cfg.nodes)
    p = plan_run(cfg, spec, spec.world)
    assert (dp is None) == (len({c.dp for c in p.candidates}) > 1)
    for c in p.candidates:  # what the trainer's step counts for that dp
        assert (c.batch, c.global_batch) == (3, cfg.data.global_batch(c.dp))
    assert "batch 3 per dp rank" in p.format_table().splitlines()[0]


def _measured_step(model_cfg, tokens: int, checkpointing: bool) -> float:
    """Bytes one bf16 forward + backward holds at its peak beyond the weights and all their
    gradients (one process, the live-tensor tracker of the memory benchmark)."""
    from tools.lab.memory import LiveTensorTracker
    from usp.attention import local_attention
    from usp.models.decoder import Transformer

    model = Transformer(model_cfg, functools.partial(local_attention, causal=True),
                        checkpoint_activations=checkpointing).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    tok, lab = (torch.randint(0, model_cfg.vocab_size, (1, tokens), generator=gen)
                for _ in range(2))
    tracker = LiveTensorTracker()
    with tracker:
        before = tracker.live
        model(tok, torch.arange(tokens), labels=lab)[0].backward()
    return tracker.peak - before - 2 * model.num_params()


@pytest.mark.parametrize("checkpointing", [True, False])
def test_layer_terms_are_within_15_percent_of_a_measured_bf16_step(checkpointing, monkeypatch):
    """The per-layer terms (activations.layer_bytes: recomputed norms, RoPE's and a norm's
    backward work, flowing gradients) against a measured bf16 step, where the logits and the
    state are small: the model's peak beyond its state is within 15% of the measured one.
    Norms that keep their fp32 work (``RMSNorm.recompute=False``) hold more."""
    from usp.models.decoder import RMSNorm
    from usp.planner.memory import state_bytes

    m = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                    loss_chunk=128, mlp_tiles=4)
    T = 512
    measured = _measured_step(m, T, checkpointing)
    s = memory_split(m, T, 1, 1, 1, dtype_bytes=2, fsdp=False, device="cpu",
                     policy=CheckpointPolicy(checkpointing))
    state_f, state_b, _ = state_bytes(m, 1, 2, False)
    modelled = s.total - (state_b if s.peak_at.startswith("backward") else state_f)
    assert abs(modelled / measured - 1) <= 0.15, (s.peak_at, modelled / T, measured / T)
    monkeypatch.setattr(RMSNorm, "recompute", False)
    assert _measured_step(m, T, checkpointing) > 1.15 * measured  # measured: 1.19, 1.40
