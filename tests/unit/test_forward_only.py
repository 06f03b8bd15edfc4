"""The planner's forward-only memory (``memory_split(..., forward_only=True)``,
``StepPolicy.forward_only``): the terms training has and scoring has not (gradients,
optimizer state, what autograd saves, the loss's backward) are gone, and usp-eval's ``auto``
layout (``resolve_eval``) is planned with it: a length training cannot fit is accepted; and
the trainer's check that its passkey lengths fit beside the optimizer state."""

from dataclasses import replace

import pytest

import usp.run.resolve as rs
from usp.config import ClusterSpec, ParallelConfig, PlanConfig
from usp.config.cluster import GiB
from usp.planner.detect import DetectReport
from usp.planner.memory import CheckpointPolicy, memory_split
from usp.planner.report import plan_report, plan_run
from usp.run import check_passkey_memory, resolve_eval

from _eval_runs import MODEL, byte_corpus, run_cfg

MIB = 2**20
KW = dict(batch=2, dtype_bytes=2, kernel="torch", device="cuda")


def test_forward_only_drops_the_gradient_optimizer_and_saved_terms():
    deep = replace(MODEL, n_layers=8)
    train = memory_split(deep, 4096, 2, 2, 2, **KW)
    fwd = memory_split(deep, 4096, 2, 2, 2, forward_only=True, **KW)
    assert fwd.total < train.total
    assert fwd.state < train.state and fwd.activations < train.activations
    assert fwd.logits < train.logits  # no log-probabilities' gradient
    assert fwd.attention < train.attention  # no backward buffers
    # nothing saved for backward: the activations do not grow with the layers
    shallow = memory_split(replace(MODEL, n_layers=2), 4096, 2, 2, 2, forward_only=True, **KW)
    assert shallow.activations == fwd.activations
    assert memory_split(replace(MODEL, n_layers=2), 4096, 2, 2, 2, **KW).activations \
        < train.activations
    # no checkpoint policy applies to a forward with no backward
    ckpt = memory_split(deep, 4096, 2, 2, 2, forward_only=True,
                        policy=CheckpointPolicy(enabled=True), **KW)
    assert ckpt == fwd
    # the weights alone: unsharded (usp-eval) they do not shrink with more ranks
    whole = memory_split(deep, 4096, 1, 2, 2, forward_only=True, fsdp=False, **KW)
    assert whole.state == memory_split(deep, 4096, 4, 2, 2, forward_only=True, fsdp=False,
                                       **KW).state


def _auto(cfg, mem_bytes):
    cluster = ClusterSpec(ranks_per_node=2, nodes=1, mem_bytes=mem_bytes)
    return replace(cfg, cluster=cluster,
                   parallel=replace(cfg.parallel, ulysses_degree="auto", ring_degree="auto"))


def test_usp_eval_plans_auto_forward_only_for_a_length_training_cannot_fit(tmp_path, monkeypatch):
    cfg = run_cfg(tmp_path / "run", byte_corpus(tmp_path / "bytes"), lengths=[4096],
                  position_loss=False)
    cfg = _auto(cfg, 32 * MIB)
    spec = cfg.cluster
    monkeypatch.setattr(rs, "detected_cluster", lambda *a: (spec, DetectReport(spec.name)))
    long_train = replace(cfg, data=replace(cfg.data, seq_len=4096))
    with pytest.raises(ValueError, match="no feasible layout .* memory refused"):
        plan_run(long_train, spec, 2)  # training at 4096 fits no layout of 2 ranks
    said = []
    layout = resolve_eval(cfg, 2, "cpu", [4096], say=said.append)
    assert layout.ulysses * layout.ring * layout.dp == 2 and layout.seq_len == 4096
    assert "memory forward only (no gradients, no optimizer state)" in said[0]


def test_the_trainers_passkey_lengths_must_fit_beside_its_optimizer_state(tmp_path):
    cfg = run_cfg(tmp_path / "run", byte_corpus(tmp_path / "bytes"), u=1, r=2,
                  during_training=True)
    check_passkey_memory(cfg, 1, 2, 1, "cpu")  # 128 and 256 tokens: far below 16 GiB
    big = replace(cfg, eval=replace(cfg.eval, lengths=[128, 2**24]))
    with pytest.raises(ValueError, match=r"a passkey forward of 2 rows at 16777216 tokens "
                       r"needs .* GiB per rank .* the longest that fits is \d+; use "
                       r"eval.lengths up to \d+"):
        check_passkey_memory(big, 1, 2, 1, "cpu")
    check_passkey_memory(replace(big, eval=replace(big.eval, during_training=False)), 1, 2, 1,
                         "cpu")


def test_usp_plan_forward_only_prices_the_forward_and_says_so():
    cfg = PlanConfig(model=MODEL, cluster=ClusterSpec(ranks_per_node=2, nodes=1, mem_bytes=GiB),
                     parallel=ParallelConfig(ulysses_degree="auto", ring_degree="auto"))
    train, _ = plan_report(cfg)
    fwd, _ = plan_report(replace(cfg, forward_only=True))
    assert "forward only" not in train
    assert "memory forward only (no gradients, no optimizer state)" in fwd.splitlines()[0]
    longest = [int(ln.split(": ")[1].split()[0]) for t in (train, fwd) for ln in t.splitlines()
               if ln.startswith("longest seq_len")]
    assert longest[1] > longest[0]
