"""Uneven head counts on gloo ranks: ``usp_attention`` vs fp64 dense attention (out, dq, dk,
dv) on 3, 4 and 8 gloo processes, one spawn per world size; bf16 errors within 2x of
single-process bf16 attention."""

import itertools

import torch
import torch.distributed as dist

from usp import SPMesh
from usp.attention import local_attention
from usp.launch import spawn_local

from _cases import check_case, dense_reference


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
