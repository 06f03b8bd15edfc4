"""Head counts that do not divide over the ulysses group.

Tier 1: ``head_split`` (contiguous query ranges, exactly the KV heads they use, the local
GQA rule, and optimality against brute-force enumeration), the refusals, and the per-rank
byte formula. Tier 3: ``usp_attention`` vs fp64 dense attention (out, dq, dk, dv) on 3, 4
and 8 gloo processes, one spawn per world size; bf16 errors within 2x of single-process
bf16 attention.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from usp import SPMesh
from tools.lab.heads import HeadsBench, HeadsRow, even_neighbours, report
from usp.attention import local_attention
from usp.launch import spawn_local
from usp.planner.traffic import attention_bytes
from usp.ulysses import check_heads, head_imbalance, head_split

from _cases import check_case, dense_reference


def _splits(max_q: int):
    for hq in range(1, max_q + 1):
        for hkv in (d for d in range(1, hq + 1) if hq % d == 0):
            for u in range(1, hq + 1):
                yield hq, hkv, u


def _brute_force_best(hq: int, hkv: int, u: int) -> tuple[int, int, int]:
    """(most query heads, most KV heads, total KV heads) of the best contiguous split in
    which every rank's KV heads serve equally many of its query heads, by enumeration."""
    group, best = hq // hkv, None
    for inner in itertools.combinations(range(1, hq), u - 1):
        cuts = (0, *inner, hq)
        ranges = list(itertools.pairwise(cuts))
        kvs = []
        for a, b in ranges:
            per_kv = {}
            for h in range(a, b):
                per_kv[h // group] = per_kv.get(h // group, 0) + 1
            if len(set(per_kv.values())) != 1:
                break
            kvs.append(len(per_kv))
        else:
            key = (max(b - a for a, b in ranges), max(kvs), sum(kvs))
            best = key if best is None or key < best else best
    return best


def test_split_examples():
    s = head_split(28, 4, 8)  # Qwen2.5-7B on 8 GPUs
    assert s.q_counts == (4, 3) * 4 and s.kv_heads == ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,))
    s = head_split(8, 2, 3)  # the middle rank straddles both KV groups
    assert s.q_ranges == ((0, 3), (3, 5), (5, 8)) and s.kv_heads == ((0,), (0, 1), (1,))
    s = head_split(6, 6, 4)
    assert s.q_counts == (2, 2, 1, 1) and s.kv_counts == (2, 2, 1, 1)
    s = head_split(24, 6, 4)  # ranges keep whole KV groups: 6 heads would split group 1
    assert s.q_counts == (8, 8, 4, 4) and s.kv_heads == ((0, 1), (2, 3), (4,), (5,))
    assert not s.even and head_split(32, 8, 4).even


def test_split_invariants_and_optimality():
    for hq, hkv, u in _splits(12):
        s = head_split(hq, hkv, u)
        group = hq // hkv
        cuts = [a for a, _ in s.q_ranges] + [hq]  # contiguous, non-empty, covering [0, hq)
        assert s.q_ranges == tuple(itertools.pairwise(cuts)) and cuts[0] == 0, (hq, hkv, u)
        assert all(a < b for a, b in s.q_ranges), (hq, hkv, u, s.q_ranges)
        for (a, b), kv in zip(s.q_ranges, s.kv_heads):
            assert kv == tuple(sorted({h // group for h in range(a, b)})), (hq, hkv, u)
            g = (b - a) // len(kv)
            assert g * len(kv) == b - a  # the kernels' rule: local head i uses kv[i // g]
            assert all(kv[i // g] == (a + i) // group for i in range(b - a)), (hq, hkv, u)
        got = (max(s.q_counts), max(s.kv_counts), sum(s.kv_counts))
        assert got == _brute_force_best(hq, hkv, u), (hq, hkv, u, s)


@pytest.mark.parametrize("hq,hkv,u", [(32, 8, 8), (32, 8, 4), (8, 2, 4), (4, 1, 4),
                                      (64, 8, 16), (32, 8, 2), (6, 6, 3)])
def test_even_split_is_plain_division(hq, hkv, u):
    s = head_split(hq, hkv, u)
    assert s.even and s.q_counts == (hq // u,) * u
    assert s.kv_counts == (max(hkv // u, 1),) * u
    assert check_heads(hq, hkv, u) == max(hkv // u, 1) and head_imbalance(hq, hkv, u) == 1.0


def test_check_heads_and_imbalance_for_uneven_counts():
    assert check_heads(6, 6, 4) == 2 and head_imbalance(6, 6, 4) == pytest.approx(4 / 3)
    assert check_heads(8, 2, 3) == 2 and head_imbalance(8, 2, 3) == pytest.approx(9 / 8)
    assert check_heads(28, 4, 8) == 1 and head_imbalance(28, 4, 8) == pytest.approx(8 / 7)
    assert check_heads(12, 4, 8) == 1  # refused before the uneven split existed


def test_heads_refusals_name_the_numbers_and_a_fix():
    with pytest.raises(ValueError, match=r"ulysses degree \(8\) > query heads \(4\).*<= 4"):
        check_heads(4, 2, 8)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of KV heads \(4\)"):
        check_heads(6, 4, 1)
    with pytest.raises(ValueError, match="positive"):
        check_heads(0, 1, 1)
    with pytest.raises(ValueError, match="ulysses degree must be a positive integer"):
        head_split(4, 2, 0)


def test_bytes_per_rank_and_the_slowest_rank():
    b, L, d, e = 1, 96, 8, 2
    for hq, hkv, u, r in ((6, 6, 4, 2), (8, 2, 3, 2), (28, 4, 8, 2), (32, 8, 4, 2)):
        s = head_split(hq, hkv, u)
        per_rank = [attention_bytes(b, L, hq, hkv, d, u, r, e, rank=j) for j in range(u)]
        fwd, bwd = attention_bytes(b, L, hq, hkv, d, u, r, e)
        for got, part in ((fwd, 0), (bwd, 1)):
            assert got == {a: max(p[part][a] for p in per_rank) for a in ("ulysses", "ring")}
        # the ring carries each rank's own KV heads: bytes per KV head equal on every rank
        ring = [p[0]["ring"] for p in per_rank]
        assert min(ring) > 0 and len({x / c for x, c in zip(ring, s.kv_counts)}) == 1
    with pytest.raises(ValueError, match="rank 4"):
        attention_bytes(b, L, 6, 6, d, 4, 1, e, rank=4)


def test_bench_compares_with_the_nearest_even_split():
    assert even_neighbours(6, 6, 4) == [(4, 4), (8, 8)]
    assert even_neighbours(6, 2, 4) == [(12, 4)]  # 3 query heads per KV head kept
    assert even_neighbours(28, 4, 8) == [(56, 8)]
    cfg = HeadsBench(heads=((6, 6), (8, 8)), seq_len=64)
    rows = [HeadsRow(6, 6, (2, 2, 1, 1), [30.0, 10.0, 20.0]), HeadsRow(8, 8, (2,) * 4, [40.0])]
    last = report(cfg, rows).splitlines()[-1].split()
    assert last[:2] == ["8/8", "2,2,2,2"] and last[-3:] == ["2.00", "1.00", "1.33"]
    with pytest.raises(ValueError, match="seq_len 60 is not a multiple of 8"):
        HeadsBench(heads=((6, 6),), seq_len=60)
    with pytest.raises(ValueError, match=r"ulysses degree \(4\) > query heads \(3\)"):
        HeadsBench(heads=((3, 1),))


# ---- tier 3: parity on gloo ----------------------------------------------------------

def _case(hq, hkv, *, balance="zigzag", dtype=torch.float32, causal=True, seq_len=48):
    return dict(batch=1, seq_len=seq_len, hq=hq, hkv=hkv, d=8, causal=causal,
                balance=balance, dtype=dtype, kernel="torch")


def _single_process_errors(case, seed):
    """Max abs errors of one-process attention in ``case['dtype']`` (the same inputs as
    ``check_case`` draws for ``seed``) against fp64 dense attention."""
    gen = torch.Generator().manual_seed(seed)
    b, L, hq, hkv, d = (case[k] for k in ("batch", "seq_len", "hq", "hkv", "d"))
    q, k, v = (torch.randn(b, L, h, d, generator=gen) for h in (hq, hkv, hkv))
    dout = torch.randn(b, L, hq, d, generator=gen)
    ref = dense_reference(q, k, v, dout, case["causal"])
    ql, kl, vl = (t.to(case["dtype"]).requires_grad_() for t in (q, k, v))
    out = local_attention(ql, kl, vl, causal=case["causal"], kernel=case["kernel"])
    out.backward(dout.to(case["dtype"]))
    return [(g.detach().double() - r).abs().max().item()
            for g, r in zip((out, ql.grad, kl.grad, vl.grad), ref)]


def _layouts_worker(layouts):
    """For each (mesh kwargs, cases): fp32 within TOL of fp64, bf16 within 2x of the
    one-process bf16 error (each error also within TOL)."""
    for mesh_kw, cases in layouts:
        with SPMesh.build(**mesh_kw) as mesh:
            for seed, case in enumerate(cases):
                errs = check_case(mesh, seed=seed, **case)
                if case["dtype"] == torch.bfloat16:
                    single = _single_process_errors(case, seed)
                    worse = [(n, e, s) for (n, e), s in zip(errs, single) if e > 2 * s]
                    assert not worse, (mesh_kw, case["hq"], case["hkv"], worse)
    dist.barrier()


def _both_balances(*heads, dtypes=(torch.float32, torch.bfloat16), seq_len=48):
    return [_case(hq, hkv, balance=bal, dtype=dt, seq_len=seq_len)
            for (hq, hkv), bal, dt in itertools.product(heads, ("zigzag", "contiguous"), dtypes)]


def test_parity_world_4():
    layouts = [
        (dict(ulysses=4, ring=1), _both_balances((6, 6), (6, 2))
         + [_case(6, 2, causal=False, balance="contiguous"), _case(5, 1)]),
        (dict(ulysses=2, ring=2), _both_balances((6, 6), (6, 2), (3, 3), (3, 1))),
        # mesh coordinates differ from process-group ranks: uneven chunks are reordered
        (dict(ulysses=4, ring=1, hosts=["b", "a", "b", "a"]), [_case(6, 6), _case(6, 2)]),
        (dict(ulysses=2, ring=2, hosts=["b", "a", "a", "b"], placement="ring_inner"),
         [_case(3, 1), _case(3, 3)]),
    ]
    spawn_local(_layouts_worker, 4, layouts)


def test_parity_world_3():
    layouts = [(dict(ulysses=3, ring=1),
                _both_balances((8, 2), (3, 1), (4, 4)) + [_case(8, 2, causal=False)])]
    spawn_local(_layouts_worker, 3, layouts)


def test_parity_world_8():
    layouts = [(dict(ulysses=8, ring=1),
                _both_balances((28, 4), dtypes=(torch.float32,), seq_len=32)
                + [_case(28, 4, dtype=torch.bfloat16, seq_len=32)])]
    spawn_local(_layouts_worker, 8, layouts)

