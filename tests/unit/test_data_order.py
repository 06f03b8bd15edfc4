"""The training data order: epochs without replacement, fixed by the seed, continued from a
count of samples; the global batch in tokens and gradient accumulation it sets."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from usp.data import MemmapTokens, TokenWriter
from usp.data.order import WindowOrder, permute
from usp.planner.batch import grad_accum_steps
from usp.run import RunLayout


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_each_epoch_is_a_permutation(n):
    for seed, epoch in ((0, 0), (0, 1), (5, 0)):
        out = permute(np.arange(n), n, seed, epoch)
        assert sorted(out.tolist()) == list(range(n))
    if n >= 64:  # shuffled, and differently per epoch and per seed
        a, b, c = (permute(np.arange(n), n, s, e) for s, e in ((0, 0), (0, 1), (1, 0)))
        assert (a != np.arange(n)).mean() > 0.9
        assert (a != b).mean() > 0.9 and (a != c).mean() > 0.9


def test_window_order_continues_from_any_count():
    order = WindowOrder(num_windows=10, seed=3)
    epoch, window = order.lookup(np.arange(30))
    assert epoch.tolist() == [0] * 10 + [1] * 10 + [2] * 10
    for e in range(3):  # every window once per epoch
        assert sorted(window[epoch == e].tolist()) == list(range(10))
    assert not np.array_equal(window[:10], window[10:20])
    # any slice of the sequence, in any batch shape, gives the same windows
    assert order.lookup(np.arange(7, 23))[1].tolist() == window[7:23].tolist()
    assert order.lookup([25])[1].tolist() == [window[25]]
    assert order.epochs(25) == 2.5


def _tokens(tmp_path, n):
    prefix = tmp_path / "tok"
    with TokenWriter(prefix, 1000, "test", "test") as w:
        w.write_document(np.arange(n) % 1000)
    return prefix


def test_memmap_windows_do_not_overlap_and_cover_an_epoch(tmp_path):
    ds = MemmapTokens(_tokens(tmp_path, 16 * 10 + 5), seq_len=16, seed=1)
    assert ds.num_windows == 10  # (165 - 1) // 16: the remainder dropped
    b = ds.rows(np.arange(10))
    starts = sorted(int(row[0]) for row in b.tokens)
    assert starts == [16 * w for w in range(10)]  # one epoch: every window once
    assert torch.equal(b.labels[:, :-1], b.tokens[:, 1:])  # each window read with its next
    assert torch.equal(b.labels[:, -1], b.tokens[:, -1] + 1)  # token (the label of the last)
    # the same samples under any dp split / micro-batch (sample ids are global)
    r0, r1 = ds.batch(0, 5, 0, 2), ds.batch(0, 5, 1, 2)
    assert torch.equal(torch.cat([r0[0], r1[0]]), b.tokens)
    first = ds.windows([0, 1])  # file order, e.g. a validation split's first windows
    assert first.tokens[:, 0].tolist() == [0, 16]
    with pytest.raises(ValueError, match=r"has windows \[0, 10\) of 16 tokens; asked for"):
        ds.windows([10])


def _layout(**kw) -> RunLayout:
    base = dict(world=4, dp=2, ring=1, ulysses=2, placement="ulysses_inner", ranks_per_node=2,
                balance="zigzag", kernel="torch", ring_impl="usp", a2a_chunks=1, device="cpu",
                dtype="fp32", seq_len=128, batch_per_dp_rank=2)
    return RunLayout(**{**base, **kw})


def test_micro_batches_split_the_step_and_equal_the_plain_rule():
    from usp.data.indexing import step_indices

    one = _layout(batch_per_dp_rank=4)
    two = _layout(batch_per_dp_rank=2, grad_accum=2)
    assert one.global_batch == two.global_batch == 8 and two.micro_batch == 4
    assert one.tokens_per_step == two.tokens_per_step == 8 * 128
    per_step = {r: list(one.samples(16, 0, r)) for r in (0, 1)}
    assert per_step == {0: [16, 17, 18, 19], 1: [20, 21, 22, 23]}
    assert list(one.samples(16, 0, 1)) == list(step_indices(2, 4, 1, 2))  # K=1: batch number 2
    split = sorted(i for k in (0, 1) for r in (0, 1) for i in two.samples(16, k, r))
    assert split == list(range(16, 24))  # the same step's samples, in micro-batches


def test_one_rule_for_sample_ids_and_a_named_held_out_range():
    from usp.data.indexing import HELD_OUT_BATCH, held_out_batch, sample_indices, step_indices

    assert list(sample_indices(100, 3, 1)) == [103, 104, 105]  # dp rank 1's share
    assert list(step_indices(2, 3, 1, 2)) == list(sample_indices(12, 3, 1))  # batch 2 of 6
    assert held_out_batch(0) == HELD_OUT_BATCH == 10**6 and held_out_batch(3) == 10**6 + 3


def test_global_batch_tokens_sets_accumulation_or_is_refused():
    tc = SimpleNamespace(global_batch_tokens=None, grad_accum_steps=None)
    assert grad_accum_steps(tc, 128, 2, 2) == 1
    tc.grad_accum_steps = 3
    assert grad_accum_steps(tc, 128, 2, 2) == 3
    tc = SimpleNamespace(global_batch_tokens=2048, grad_accum_steps=None)
    assert grad_accum_steps(tc, 128, 2, 2) == 4  # 2048 / (128 x 2 x 2)
    assert grad_accum_steps(tc, 128, 2, 1) == 8  # dp halved: accumulation doubles
    tc.global_batch_tokens = 1500
    with pytest.raises(ValueError, match=r"global_batch_tokens=1500 is not a whole number of "
                                         r"micro-batches .* = 512 tokens; the nearest valid "
                                         r"values: 1024 \(grad_accum_steps 2\) or 1536 "
                                         r"\(grad_accum_steps 3\)"):
        grad_accum_steps(tc, 128, 2, 2)
    tc.global_batch_tokens = 100
    with pytest.raises(ValueError, match=r"nearest valid values: 512 \(grad_accum_steps 1\)$"):
        grad_accum_steps(tc, 128, 2, 2)
    tc = SimpleNamespace(global_batch_tokens=2048, grad_accum_steps=2)
    with pytest.raises(ValueError, match=r"means grad_accum_steps 4 .* but "
                                         r"trainer.grad_accum_steps=2; set one of the two"):
        grad_accum_steps(tc, 128, 2, 2)


def test_blend_interleaves_by_weight_and_resumes_from_a_count():
    from usp.data.blend import BlendOrder, quotas

    assert quotas([0.7, 0.3], 10).tolist() == [7, 3]
    assert quotas([1, 1, 1], 10).tolist() == [4, 3, 3] and quotas([1, 1, 1]).sum() == 4096
    order = BlendOrder([0.7, 0.3], block=10)
    corpus, ordinal = order.lookup(np.arange(40))
    assert np.bincount(corpus).tolist() == [28, 12]  # the weights, exactly per block
    for j in (0, 1):  # each corpus's ordinals count up 0, 1, 2, ... in sample order
        assert ordinal[corpus == j].tolist() == list(range((corpus == j).sum()))
    assert max(np.diff(np.flatnonzero(corpus == 1))) <= 4  # spread, not bunched
    assert order.counts(23).tolist() == np.bincount(corpus[:23], minlength=2).tolist()
    again = order.lookup(np.arange(17, 33))  # any slice: the same
    assert again[0].tolist() == corpus[17:33].tolist()
    assert again[1].tolist() == ordinal[17:33].tolist()
    with pytest.raises(ValueError, match=r"weight 1e-05 of source 1 is under one sample"):
        BlendOrder([1.0, 1e-5])


def test_blend_rows_come_from_their_corpus(tmp_path):
    from usp.data.blend import Blend

    prefixes = []
    for j, base in enumerate((0, 500)):
        prefix = tmp_path / f"c{j}"
        with TokenWriter(prefix, 1000, "test", "test") as w:
            w.write_document(base + np.arange(16 * 8 + 1) % 400)
        prefixes.append(prefix)
    sources = [MemmapTokens(p, seq_len=16, seed=j) for j, p in enumerate(prefixes)]
    blend = Blend(sources, [3, 1], ["c0", "c1"])
    b = blend.rows(np.arange(8))
    corpus, ordinal = blend.order.lookup(np.arange(8))
    for i in range(8):
        want = sources[corpus[i]].rows([ordinal[i]])
        assert torch.equal(b.tokens[i], want.tokens[0]) and torch.equal(b.labels[i], want.labels[0])
    assert ((b.tokens >= 500).all(1) == torch.from_numpy(corpus == 1)).all()
    counts = blend.order.counts(4096 + 8)
    assert blend.epochs(4096 + 8) == {"c0": counts[0] / 8, "c1": counts[1] / 8}


# ---- length phases: each phase its own passes at its length, ordered by (seed, phase, epoch)


def test_phase_zero_is_the_order_of_a_run_without_phases():
    # pinned from the order before phases existed: single-phase runs read what they read
    order = WindowOrder(num_windows=10, seed=3)
    assert order.lookup(np.arange(20))[1].tolist() == [7, 4, 3, 8, 2, 6, 5, 0, 1, 9,
                                                       6, 0, 1, 2, 5, 4, 7, 9, 3, 8]
    assert WindowOrder(10, 3, phase=0).lookup(np.arange(20))[1].tolist() == \
        order.lookup(np.arange(20))[1].tolist()


def test_a_later_phase_makes_its_own_passes_at_its_length(tmp_path):
    prefix = _tokens(tmp_path, 16 * 40 + 1)
    short = MemmapTokens(prefix, seq_len=16, seed=1)  # phase 0: 40 windows of 16
    long = MemmapTokens(prefix, seq_len=64, seed=1, phase=1)  # phase 1: 10 windows of 64
    assert (short.num_windows, long.num_windows) == (40, 10)
    # phase 1 starts its count at 0: its first 10 samples are every 64-window once, whatever
    # phase 0 consumed; its second pass is another permutation of them
    first = long.rows(np.arange(10)).tokens[:, 0].tolist()
    assert sorted(first) == [64 * w % 1000 for w in range(10)]
    second = long.rows(np.arange(10, 20)).tokens[:, 0].tolist()
    assert sorted(second) == sorted(first) and second != first
    # keyed by the phase: the same length in another phase is another order
    again = MemmapTokens(prefix, seq_len=64, seed=1, phase=2)
    assert again.order.lookup(np.arange(10))[1].tolist() != \
        long.order.lookup(np.arange(10))[1].tolist()
    assert long.order.epochs(15) == 1.5  # epochs count the phase's own passes


def test_recall_samples_of_a_phase_are_at_its_length_and_keyed_by_it():
    from usp.data.synthetic import RecallTask

    base = RecallTask(vocab_size=320, seq_len=128, seed=4)
    pinned = RecallTask(vocab_size=320, seq_len=128, seed=4, phase=0)
    assert np.array_equal(base.sample(3)[0], pinned.sample(3)[0])
    longer = RecallTask(vocab_size=320, seq_len=256, seed=4, phase=1)
    tokens, labels = longer.sample(3)
    assert tokens.shape == labels.shape == (256,)
    same_len = RecallTask(vocab_size=320, seq_len=128, seed=4, phase=1)
    assert not np.array_equal(same_len.sample(3)[0], base.sample(3)[0])
