"""``model.loss_chunk=auto`` / ``model.mlp_tiles=auto`` (``usp.planner.tiles``): the largest
chunk and the fewest tiles under the share, resolved to numbers before any model is built,
trained exactly as the numbers they chose; the chunked loss's term against its measured
peak; usp-plan's longest mode (the longest fits, one step more does not)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_tiling import LOCAL, _assert_same, _batch, _model_grads

from tools.lab.memory import LiveTensorTracker
from usp.config import ClusterSpec, ModelConfig, RunConfig
from usp.config.cluster import GiB
from usp.models.decoder import Transformer
from usp.models.tiling import chunked_lm_loss
from usp.planner import CheckpointPolicy
from usp.planner.fit import longest_seq_len
from usp.planner.memory import logits_bytes
from usp.planner.options import StepPolicy
from usp.planner.tiles import MIN_CHUNK, TILE_SHARE, mlp_bytes, size_tiles
from usp.run import resolve_eval, resolve_phases

L8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                  ffn_dim=14336, tie_embeddings=False, loss_chunk="auto", mlp_tiles="auto")
CKPT = CheckpointPolicy(True, offload=True)


def test_auto_picks_the_largest_chunk_and_fewest_tiles_under_the_share():
    budget, L, u = 72 * GiB, 1 << 20, 8
    c = size_tiles(L8B, L, 1, u, budget, policy=CKPT)
    m, T, limit = c.model, L / u, TILE_SHARE * budget
    assert c.limit == limit and c.logits <= limit and c.mlp <= limit
    assert MIN_CHUNK <= m.loss_chunk < T and m.mlp_tiles > 1
    # one step further along each key's order leaves the share
    assert logits_bytes(replace(m, loss_chunk=2 * m.loss_chunk), 1, T, 2) > limit
    assert mlp_bytes(replace(m, mlp_tiles=m.mlp_tiles // 2), T, 1, 2, CKPT) > limit
    # shorter on the same GPUs: a larger chunk, fewer tiles; set keys are kept
    short = size_tiles(L8B, L // 8, 1, u, budget, policy=CKPT).model
    assert short.loss_chunk >= m.loss_chunk and short.mlp_tiles < m.mlp_tiles
    kept = size_tiles(replace(L8B, loss_chunk=64), L, 1, u, budget, policy=CKPT).model
    assert kept.loss_chunk == 64 and kept.mlp_tiles == m.mlp_tiles


def test_no_share_fits_the_smallest_chunk_and_most_tiles_and_the_note_says_so():
    from usp.planner.tiles import tile_note

    c = size_tiles(L8B, 1 << 20, 1, 1, 1 * GiB, policy=CKPT)
    assert c.model.loss_chunk == MIN_CHUNK and c.model.mlp_tiles == 1024
    note = tile_note(L8B, c)
    assert "model.loss_chunk=auto -> 1024, model.mlp_tiles=auto -> 1024" in note
    assert "logits and MLP over it even so" in note


@pytest.mark.parametrize("bad", ["big", 1.5, True, -1])
def test_a_chunk_neither_a_number_nor_auto_is_refused(bad):
    with pytest.raises(ValueError, match="model.loss_chunk"):
        ModelConfig(loss_chunk=bad)


def _auto_run(**model) -> RunConfig:
    """The tiny model on 2 x 2 with a 4 MiB device: auto must tile the MLP."""
    m = ModelConfig(vocab_size=256, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48,
                    **model)
    return RunConfig(model=m, cluster=ClusterSpec(mem_bytes=4 * 2**20))


def test_auto_is_resolved_before_the_model_and_trains_as_the_values_it_chose():
    said: list[str] = []
    plan = resolve_phases(_auto_run(loss_chunk="auto", mlp_tiles="auto", norm_tiles="auto"),
                          4, "cpu", env={}, say=said.append)
    run, chosen = plan[0].run, plan[0].cfg.model
    assert (chosen.loss_chunk, chosen.mlp_tiles, chosen.norm_tiles) == (
        run.loss_chunk, run.mlp_tiles, run.norm_tiles)
    assert plan.cfg.model == chosen and chosen.mlp_tiles > 1 and chosen.loss_chunk > 0
    assert (f"usp: model.loss_chunk=auto -> {run.loss_chunk}, model.mlp_tiles=auto -> "
            f"{run.mlp_tiles}") in "\n".join(said)
    tokens, labels = _batch()
    explicit = replace(chosen, loss_chunk=run.loss_chunk, mlp_tiles=run.mlp_tiles,
                       norm_tiles=run.norm_tiles)
    models = []
    for cfg in (chosen, explicit, replace(chosen, loss_chunk=0, mlp_tiles=1, norm_tiles=1)):
        model = Transformer(cfg, LOCAL)
        model.init_weights(1)
        models.append(_model_grads(model, tokens, labels))
    _assert_same(models[0], models[1])  # auto trains as the numbers it picked
    _assert_same(models[0], models[2])  # and as the untiled model (1e-6)
    # usp-eval sizes them too (forward only), and a transformers model is refused
    scored = resolve_eval(_auto_run(loss_chunk="auto"), 4, "cpu", [256], env={})
    assert scored.loss_chunk == MIN_CHUNK and scored.mlp_tiles == 1
    hf = replace(_auto_run(), model=replace(_auto_run().model, hf="llama", loss_chunk="auto"))
    with pytest.raises(ValueError, match="model.loss_chunk=auto"):
        resolve_phases(hf, 4, "cpu", env={})


@pytest.mark.parametrize("dtype,V,D,n,c", [  # bf16 matmuls are slow on CPU: a small one
    (torch.float32, 4096, 256, 2048, 512),  # the chunk's logits and softmax dominate
    (torch.float32, 2048, 512, 1024, 128),  # the chunk's dW and the accumulator dominate
    (torch.bfloat16, 2048, 128, 512, 128)])
def test_chunked_loss_term_within_15_percent_of_its_measured_peak(dtype, V, D, n, c):
    """Live tensor bytes (``LiveTensorTracker``) of the chunked loss's forward and backward
    beyond h and the head weight, against ``logits_bytes`` on CUDA's terms (the CPU's fp32
    copy inside the accumulating add is scratch of one op the tracker cannot see)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, n, D, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(V, D, generator=gen).to(dtype).requires_grad_()
    y = torch.randint(0, V, (1, n), generator=gen)
    tracker = LiveTensorTracker()
    with tracker:
        tracker.see(h.untyped_storage())
        tracker.see(w.untyped_storage())
        base = tracker.live
        loss, _ = chunked_lm_loss(h, w, y, c)
        loss.backward()
    measured = tracker.peak - base
    modelled = logits_bytes(ModelConfig(vocab_size=V, dim=D, loss_chunk=c), 1, n,
                            dtype.itemsize)
    assert abs(modelled - measured) <= 0.15 * measured, (modelled, measured)


def test_longest_fits_and_one_step_more_does_not():
    step = StepPolicy(checkpoint=CKPT)
    budget = step.budget(ClusterSpec(mem_bytes=80 * GiB))
    n = longest_seq_len(L8B, budget, 1, 1, 8, step)
    assert n > 0 and n % 16 == 0
    assert step.memory(L8B, n, 1, 1, 8, 1, budget=budget).total <= budget
    assert step.memory(L8B, n + 16, 1, 1, 8, 1, budget=budget).total > budget
    with pytest.raises(ValueError, match="budget"):
        step.memory(L8B, n, 1, 1, 8, 1)


def test_usp_plan_longest_is_the_longest_any_layout_holds():
    """``usp-plan longest=true`` on 2 GPUs: its length fits its layout, and no layout holds
    one step more; a target length no layout divides is rounded up and said."""
    import re

    from usp.config import ParallelConfig, PlanConfig, RecallData, TrainerConfig
    from usp.planner.longest import longest_report
    from usp.planner.report import plan_report, run_step
    from usp.rules import seq_multiple

    spec = ClusterSpec(name="h100x2", ranks_per_node=2, nodes=1, mem_bytes=80 * GiB)
    cfg = PlanConfig(model=L8B, cluster=spec, longest=True, data=RecallData(batch_per_dp_rank=1),
                     parallel=ParallelConfig(ulysses_degree="auto", ring_degree="auto"),
                     trainer=TrainerConfig(dtype="bf16", activation_checkpointing=True,
                                           activation_offload=True))
    text = longest_report(cfg)
    got = re.search(r"\): (\d+) tokens on ulysses (\d+) x ring (\d+) x dp (\d+)", text)
    n, u, r, d = map(int, got.groups())
    step = run_step(cfg)
    budget = step.budget(spec)
    assert step.memory(L8B, n, d, r, u, 1, budget=budget).total <= budget
    for d2, r2, u2 in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        more = n + seq_multiple(u2, r2, "zigzag")
        assert step.memory(L8B, more, d2, r2, u2, 1, budget=budget).total > budget
    assert "model.loss_chunk=auto -> " in text and "modelled step time" in text
    host = re.search(r"host memory per node ([\d.]+) GiB of ([\d.]+) GiB", text)  # offloaded
    assert host and 0 < float(host.group(1)) < float(host.group(2))
    odd = replace(cfg, longest=False, data=RecallData(seq_len=n // 2 + 1, batch_per_dp_rank=1))
    assert f"data.seq_len {n // 2 + 1} rounded up to " in plan_report(odd)[0]


def test_each_phase_resizes_auto_at_its_length():
    from usp.config import TrainerConfig
    from usp.config.phases import PhaseConfig

    phases = [PhaseConfig(seq_len=256, steps=1), PhaseConfig(seq_len=2048, steps=1),
              PhaseConfig(seq_len=2048, steps=1, mlp_tiles=3)]
    cfg = replace(_auto_run(loss_chunk="auto", mlp_tiles="auto"),
                  trainer=TrainerConfig(steps=3, phases=phases))
    plan = resolve_phases(cfg, 4, "cpu", env={})
    tiles = [p.cfg.model.mlp_tiles for p in plan.phases]
    assert [p.run.mlp_tiles for p in plan.phases] == tiles
    assert 1 < tiles[0] < tiles[1] and tiles[2] == 3  # longer: more tiles; a set one is kept
    assert all(p.cfg.model.loss_chunk == MIN_CHUNK for p in plan.phases)


def test_norm_tiles_hold_one_tiles_backward_work_as_the_planner_prices_it():
    """``model.norm_tiles``: a block norm's backward holds one tile's fp32 work (live tensor
    bytes of the norm's forward and backward beyond its input and output gradient, 1 tile
    against 4), within 15% of ``norm_work_bytes``; auto picks the fewest tiles that keep
    that work under the share, and the tiled norm's output and gradients are the untiled
    one's (its weight's gradient summed tile by tile: 1e-6)."""
    from tools.lab.memory import LiveTensorTracker
    from usp.models.decoder import RMSNorm
    from usp.planner.activations import norm_work_bytes

    n, D = 4096, 256
    gen = torch.Generator().manual_seed(0)
    x0, g0 = (torch.randn(1, n, D, generator=gen).bfloat16() for _ in range(2))
    got = {}
    for tiles in (1, 4):  # bf16 as the planner prices it (fp32 input: its copy is x itself)
        norm, x = RMSNorm(D, 1e-5).bfloat16(), x0.clone().requires_grad_()
        norm.tiles = tiles
        tracker = LiveTensorTracker()
        with tracker:
            for t in (x, g0, norm.weight):
                tracker.see(t.untyped_storage())
            base = tracker.live
            y = norm(x)
            y.backward(g0)
        work = tracker.peak - base - 2 * x.nbytes  # beyond the output and x's gradient
        modelled = norm_work_bytes(ModelConfig(dim=D, norm_tiles=tiles), n)
        assert abs(modelled - work) <= 0.15 * work, (tiles, modelled, work)
        got[tiles] = (y.detach(), x.grad, norm.weight.grad)
    assert torch.equal(got[4][0], got[1][0]) and torch.equal(got[4][1], got[1][1])
    w4, w1 = got[4][2].float(), got[1][2].float()  # bf16, summed in another order
    assert (w4 - w1).abs().max() <= 1e-2 * w1.abs().max()
    # a budget whose share is under usp.dims.work.NORM_BYTES, the tiles a norm takes alone
    budget, L, u = 4 * GiB, 1 << 20, 8
    m = size_tiles(replace(L8B, norm_tiles="auto"), L, 1, u, budget, policy=CKPT).model
    limit, T = TILE_SHARE * budget, L / u
    assert m.norm_tiles > 1 and norm_work_bytes(m, T) <= limit
    assert norm_work_bytes(replace(m, norm_tiles=m.norm_tiles // 2), T) > limit
