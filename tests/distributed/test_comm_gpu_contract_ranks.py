"""What the GPU path relies on, checked on gloo ranks: host staging keeps results exact, no
per-call index copies, ring P2P on the ring's own group, and the kernel preflight running
before any collective."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import usp.comm
from usp import SequenceLayout, SPMesh, usp_attention
from usp.launch import spawn_local

from _cases import TOL, check_case, dense_reference


def _staging_worker():
    case = dict(batch=1, seq_len=32, hq=8, hkv=2, d=8, causal=True, balance="zigzag",
                dtype=torch.float32, kernel="torch", seed=3)
    mesh = SPMesh.build(ulysses=2, ring=2, ranks_per_node=2)
    direct = check_case(mesh, **case)
    staged = []
    real = usp.comm.wire.stage_through_host

    def always(device_type, backend):  # what a CUDA tensor on gloo gets
        staged.append(backend)
        return True

    usp.comm.wire.stage_through_host = always
    try:
        via_host = check_case(mesh, **case)  # all-to-all, ring P2P and layout.gather
    finally:
        usp.comm.wire.stage_through_host = real
    assert staged and set(staged) == {"gloo"}, staged
    assert via_host == direct  # the same max errors as the direct path


def test_host_staging_keeps_results_exact():
    spawn_local(_staging_worker, 4)


# ---- defect 7: no index tensors made or copied per call -----------------------------------


def _has_list(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) for p in parts)


_MAKERS = (torch.tensor, torch.as_tensor, torch.arange, torch.Tensor.new_tensor)


class _IndexMaking(TorchFunctionMode):
    """Records every index tensor made from Python data or by arange, every indexing with a
    Python list (which makes one), and every ``.to()`` of an integer tensor."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MAKERS:
            self.made.append(func.__name__)
        elif func is torch.Tensor.__getitem__ and _has_list(args[1]):
            self.made.append(f"__getitem__ {args[1]}")
        elif func is torch.Tensor.to and not args[0].is_floating_point():
            self.made.append(f"to {args[0].dtype}")
        return func(*args, **(kwargs or {}))


def _index_worker():
    # ring_inner with hosts b, a, a, b: ulysses groups (0, 1) and (3, 2), so on ranks 2 and
    # 3 mesh coordinates differ from group ranks; 1 KV head over u = 2: replicated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ulysses group spans nodes": intended here
        mesh = SPMesh.build(ulysses=2, ring=2, hosts=["b", "a", "a", "b"], placement="ring_inner")
    assert (mesh.to_group_rank("ulysses") is not None) == (dist.get_rank() in (2, 3))
    gen = torch.Generator().manual_seed(0)
    b, L, hq, hkv, d = 1, 32, 8, 1, 8
    q, k, v = (torch.randn(b, L, h, d, generator=gen) for h in (hq, hkv, hkv))
    dout = torch.randn(b, L, hq, d, generator=gen)
    lay = SequenceLayout(mesh, seq_len=L)
    local = [lay.shard(t, dim=1) for t in (q, k, v, dout)]

    def call():
        ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
        out = usp_attention(ql, kl, vl, mesh=mesh, layout=lay, kernel="torch")
        out.backward(local[3])
        return [out.detach(), ql.grad, kl.grad, vl.grad]

    first = call()  # may build the indices it needs, once
    with _IndexMaking() as rec:
        second = call()
    assert rec.made == [], rec.made
    for a, b_ in zip(first, second):
        assert torch.equal(a, b_)
    ref = dense_reference(q, k, v, dout, causal=True)
    for got, want in zip(second, ref):
        err = (lay.gather(got, dim=1).double() - want).abs().max().item()
        assert err <= TOL[torch.float32], err


def test_second_call_makes_no_index_tensors():
    spawn_local(_index_worker, 4)


# ---- defect 9: ring P2P on the ring's own group ---------------------------------------------


def _ring_group_worker():
    real = dist.batch_isend_irecv
    groups = []

    def spy(ops):
        groups.extend(op.group for op in ops)
        return real(ops)

    dist.batch_isend_irecv = spy
    for u, r in ((1, 2), (2, 2)):  # (1, 2) runs with dp = 2
        mesh = SPMesh.build(ulysses=u, ring=r, ranks_per_node=2)
        groups.clear()
        check_case(mesh, batch=1, seq_len=16, hq=4, hkv=2, d=8, causal=True,
                   balance="zigzag", dtype=torch.float32, kernel="torch", seed=1)
        ring = mesh.group("ring")
        assert groups and all(g is ring for g in groups), (u, r, len(groups))
        assert dist.get_process_group_ranks(ring) == sorted(mesh.axis_ranks("ring"))
        assert mesh.comm.clock == "host" and mesh.comm.seconds["ring"] > 0
    dist.batch_isend_irecv = real


def test_ring_p2p_runs_on_the_ring_group():
    spawn_local(_ring_group_worker, 4)


# ---- defect 12: kernel preflight before any collective ---------------------------------------


def _preflight_worker():
    mesh = SPMesh.build(ulysses=2, ring=1)
    lay = SequenceLayout(mesh, seq_len=16, balance="zigzag")

    def boom(*a, **k):
        raise AssertionError("a collective ran before validation")

    dist.all_to_all_single = boom  # this spawned process ends after the test
    dist.batch_isend_irecv = boom
    q = torch.randn(1, 8, 4, 8)
    for kw, needle in (
        (dict(ring_impl="ring_flash_attn"), "CUDA kernels, but the tensors are on cpu"),
        (dict(kernel="flash_attn"), "kernel='flash_attn' is CUDA only"),
        (dict(ring_impl="stripes"), "ring_impl must be one of"),
        (dict(kernel="xformers"), "unknown attention kernel 'xformers'"),
    ):
        with pytest.raises(ValueError, match=needle):
            usp_attention(q, q, q, mesh=mesh, layout=lay, **kw)


def test_kernel_preflight_runs_before_any_collective():
    spawn_local(_preflight_worker, 2)
