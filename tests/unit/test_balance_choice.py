"""``parallel.balance``: ``auto`` resolved once into ``RunLayout.balance`` (per_document for
packed documents under the document mask on usp's ring, else zigzag), usp-eval's rows kept
zigzag, usp-plan saying which, and the refusals of a per_document that cannot run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from usp.config import (ModelConfig, ParallelConfig, PlanConfig, RecallData, RunConfig,
                        TrainerConfig)
from usp.dims.balance import choose_balance
from usp.planner.report import plan_report
from usp.run import decide_balance, resolve_eval, resolve_run
from usp.rules import check_seq_len

MODEL = ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
PACKED = RecallData(seq_len=256, batch_per_dp_rank=2, documents_per_row=2, packing="documents")
ROWS = RecallData(seq_len=256, batch_per_dp_rank=2, documents_per_row=2)  # no document mask


def _cfg(data=PACKED, **parallel) -> RunConfig:
    kw = dict(ulysses_degree=2, ring_degree=2, ranks_per_node=2) | parallel
    return RunConfig(model=MODEL, parallel=ParallelConfig(**kw), data=data,
                     trainer=TrainerConfig(nprocs=4))


def test_auto_chooses_per_document_for_packed_documents_on_usps_ring():
    said = []
    run = resolve_run(_cfg(), 4, "cpu", say=said.append)
    assert run.balance == "per_document"
    assert said[0].startswith("usp: balance per_document (parallel.balance=auto: "
                              "data.packing=documents")
    assert resolve_run(_cfg(ROWS), 4, "cpu").balance == "zigzag"  # one sequence a row
    assert choose_balance("auto", True, "ring_flash_attn")[0] == "zigzag"  # rows it can run
    assert choose_balance("auto", False, "usp") == (
        "zigzag", "parallel.balance=auto: the rows are one causal sequence each "
                  "(data.packing=none)")


def test_a_set_balance_is_kept():
    for balance in ("zigzag", "contiguous", "per_document"):
        assert resolve_run(_cfg(balance=balance), 4, "cpu").balance == balance
    assert resolve_run(_cfg(ROWS, balance="contiguous"), 4, "cpu").balance == "contiguous"


def test_usp_eval_keeps_zigzag_rows():
    # usp-eval's rows are one sequence each, without the document mask
    for balance in ("auto", "per_document"):
        assert resolve_eval(_cfg(balance=balance), 4, "cpu", [256]).balance == "zigzag"
    assert resolve_eval(_cfg(balance="contiguous"), 4, "cpu", [256]).balance == "contiguous"


@pytest.mark.parametrize("cfg,needles", [
    (_cfg(ROWS, balance="per_document"),
     ["parallel.balance=per_document", "data.packing=none", "set data.packing=documents, or "
      "parallel.balance=auto or zigzag"]),
    (_cfg(balance="per_document", a2a_chunks=2),
     ["parallel.a2a_chunks=2", "a ring pass per row", "use parallel.a2a_chunks=1"]),
])
def test_a_per_document_that_cannot_run_is_refused(cfg, needles):
    with pytest.raises(ValueError) as e:
        resolve_run(cfg, 4, "cpu")
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_per_document_needs_usps_ring():
    # (a run with ring_impl=ring_flash_attn is refused earlier for its document mask; the
    # balance's own rule, as the resolver takes it)
    with pytest.raises(ValueError, match="but parallel.ring_impl=ring_flash_attn; use "
                                         "parallel.ring_impl=usp, or parallel.balance=zigzag"):
        decide_balance(_cfg(balance="per_document", ring_impl="ring_flash_attn"))


def test_per_document_needs_2_ring_ulysses_to_divide_the_row():
    check_seq_len(24, 3, 2, "per_document")  # 2 x 2 x 3 = 12 | 24
    with pytest.raises(ValueError, match=r"sequence length 20 is not divisible by 2 x ring x "
                                         r"ulysses = 12 .*balance=per_document.*use seq_len 12 "
                                         r"or 24"):
        check_seq_len(20, 3, 2, "per_document")
    with pytest.raises(ValueError, match="sequence length 250 is not divisible"):
        resolve_run(_cfg(replace(PACKED, seq_len=250)), 4, "cpu")


def test_auto_a2a_chunks_stay_whole_under_per_document():
    # a ulysses group across simulated nodes pipelines its all-to-alls under zigzag ...
    long = dict(seq_len=1 << 16, batch_per_dp_rank=1, documents_per_row=2)
    across = dict(ranks_per_node=1)
    zig = resolve_run(_cfg(RecallData(**long), **across), 4, "cpu")
    assert zig.balance == "zigzag" and zig.a2a_chunks > 1
    # ... and not under per_document, whose ring runs row by row
    per = resolve_run(_cfg(RecallData(**long, packing="documents"), **across), 4, "cpu")
    assert per.balance == "per_document" and per.a2a_chunks == 1


def test_usp_plan_says_which_balance_and_why():
    cfg = PlanConfig(model=MODEL, data=PACKED,
                     parallel=ParallelConfig(ulysses_degree="auto", ring_degree="auto"))
    text, _ = plan_report(cfg)
    assert ", per_document" in text.splitlines()[0]  # the table's head: what it priced
    assert "balance: per_document (parallel.balance=auto: data.packing=documents" in text
    text, _ = plan_report(replace(cfg, data=ROWS))
    assert ", zigzag" in text.splitlines()[0]
    assert "balance: zigzag (parallel.balance=auto: the rows are one causal sequence" in text
