"""What the GPU path relies on, checked on CPU: the comm clock, no per-call index copies,
the ring's own group, host staging for gloo, ring-flash-attn's byte accounting, and the
kernel preflight running before any collective."""

import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import usp.comm
from usp import CommStats, SequenceLayout, SPMesh, usp_attention
from usp.comm import clock_for, stage_through_host
from usp.launch import spawn_local

from _cases import TOL, check_case, dense_reference

# ---- defect 6: CUDA tensors are timed with events, resolved lazily ------------------------


def test_clock_follows_the_device():
    assert clock_for(torch.device("cuda", 0)) == "cuda_events"
    assert clock_for("cuda") == "cuda_events"
    assert clock_for(torch.device("cpu")) == "host"


class _Timeline:
    """A fake GPU: events take the time of a clock the test advances."""

    now_ms = 0.0
    syncs = 0
    made = 0


class _FakeEvent:
    def __init__(self, enable_timing=False):
        assert enable_timing, "elapsed_time needs enable_timing=True"
        _Timeline.made += 1
        self.t = None

    def record(self, stream=None):
        self.t = _Timeline.now_ms

    def synchronize(self):
        _Timeline.syncs += 1

    def elapsed_time(self, end):
        assert self.t is not None and end.t is not None, "elapsed_time of an unrecorded event"
        return end.t - self.t


def test_cuda_spans_use_events_and_resolve_only_when_read(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a device-wide synchronize on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    monkeypatch.setattr(_Timeline, "now_ms", 0.0)
    monkeypatch.setattr(_Timeline, "syncs", 0)
    stats = CommStats(event_factory=_FakeEvent)
    blocked_ms = {"ulysses": [3.0, 5.0], "ring": [2.5]}
    for axis, spans in blocked_ms.items():
        for ms in spans:
            with stats.timed(axis, torch.device("cuda", 0)):
                _Timeline.now_ms += ms  # the stream waits for the communication
            _Timeline.now_ms += 100.0  # compute between calls is not communication
    assert stats.clock == "cuda_events"
    assert _Timeline.syncs == 0  # nothing waited for the GPU while timing
    assert stats.seconds["ulysses"] == pytest.approx(sum(blocked_ms["ulysses"]) / 1e3)
    assert stats.seconds["ring"] == pytest.approx(sum(blocked_ms["ring"]) / 1e3)
    assert _Timeline.syncs == 3  # one per span, when read
    assert stats.total_seconds() == pytest.approx(10.5 / 1e3)
    assert _Timeline.syncs == 3  # resolved spans are not resolved again


def test_cpu_spans_use_the_host_clock(monkeypatch):
    monkeypatch.setattr(_Timeline, "made", 0)
    stats = CommStats(event_factory=_FakeEvent)
    with stats.timed("ring", torch.device("cpu")):
        sum(range(10_000))
    assert stats.clock == "host" and _Timeline.made == 0
    assert stats.seconds["ring"] > 0


# ---- transport shim: CUDA tensors on gloo travel through the host --------------------------


@pytest.mark.parametrize(
    "device_type,backend,staged",
    [
        ("cpu", "gloo", False),
        ("cpu", "nccl", False),
        ("cuda", "gloo", True),
        ("cuda", "nccl", False),
        ("cuda", "cpu:gloo,cuda:nccl", False),
        ("cuda", "cuda:gloo,cpu:gloo", True),
        ("cuda", "cpu:gloo", True),  # nothing serves cuda: gloo carries a host copy
        ("cuda", "undefined", False),  # torch's default: nccl for cuda
    ],
)
def test_stage_through_host_decision(device_type, backend, staged):
    assert stage_through_host(device_type, backend) is staged


def _staging_worker():
    case = dict(batch=1, seq_len=32, hq=8, hkv=2, d=8, causal=True, balance="zigzag",
                dtype=torch.float32, kernel="torch", seed=3)
    mesh = SPMesh.build(ulysses=2, ring=2, ranks_per_node=2)
    direct = check_case(mesh, **case)
    staged = []
    real = usp.comm.stage_through_host

    def always(device_type, backend):  # what a CUDA tensor on gloo gets
        staged.append(backend)
        return True

    usp.comm.stage_through_host = always
    try:
        via_host = check_case(mesh, **case)  # all-to-all, ring P2P and layout.gather
    finally:
        usp.comm.stage_through_host = real
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


# ---- ring-flash-attn: its traffic is recorded like ours --------------------------------------


class _FakeRingGroup:
    def __init__(self, size):
        self.size = size


def _stand_in_module(sent: dict) -> types.ModuleType:
    """``ring_flash_attn`` 0.1.8's two functions, with their signatures, the zigzag causal
    assert, and the send loops of its forward and backward: ``sent`` counts the bytes its
    ``RingComm`` would send to another rank. The attention itself is a stand-in."""

    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    class Func(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, group):
            r = ctx.r = group.size
            ctx.save_for_backward(k, v)
            for step in range(r):
                if step + 1 != r:
                    sent["fwd"] += nbytes(k, v)  # kv_comm.send_recv_kv(k, v)
            return q * 1.0

        @staticmethod
        def backward(ctx, dout):
            k, v = ctx.saved_tensors
            r = ctx.r
            dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (k, v))  # fp32, as sent
            for step in range(r):
                if step + 1 != r:
                    sent["bwd"] += nbytes(k, v)  # kv_comm.send_recv_kv(k, v)
                if r > 1:  # d_kv_comm.send_recv_kv(dk, dv) every step; to itself when r == 1
                    sent["bwd"] += nbytes(dk, dv)
            return dout, dk.to(k.dtype), dv.to(v.dtype), None

    def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                             return_attn_probs=False, group=None):
        sent["called"].append(("ring", group))
        return Func.apply(q, k, v, group)

    def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, group=None):
        assert causal == True, "zigzag ring is meaningless for causal=False"  # noqa: E712
        sent["called"].append(("zigzag", group))
        return Func.apply(q, k, v, group)

    mod = types.ModuleType("ring_flash_attn")
    mod.ring_flash_attn_func = ring_flash_attn_func
    mod.zigzag_ring_flash_attn_func = zigzag_ring_flash_attn_func
    return mod


@pytest.mark.parametrize("ring,balance,dtype", [
    (4, "zigzag", torch.bfloat16), (2, "contiguous", torch.bfloat16), (1, "zigzag", torch.float16),
])
def test_ring_flash_attn_records_its_traffic(monkeypatch, ring, balance, dtype):
    from usp.ring_flash import ring_flash_attn

    sent = {"fwd": 0, "bwd": 0, "called": []}
    monkeypatch.setitem(sys.modules, "ring_flash_attn", _stand_in_module(sent))
    group = _FakeRingGroup(ring)
    mesh = types.SimpleNamespace(ring=ring, comm=CommStats(), group={"ring": group}.__getitem__,
                                 to_group_rank=lambda axis: None)
    q = torch.randn(2, 16, 4, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 16, 2, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 16, 2, 8, dtype=dtype, requires_grad=True)
    out = ring_flash_attn(q, k, v, mesh, balance, True, 8 ** -0.5)
    assert sent["called"] == [("zigzag" if balance == "zigzag" else "ring", group)]
    assert mesh.comm.bytes["ring"] == sent["fwd"]
    mesh.comm.reset()
    out.sum().backward()
    assert mesh.comm.bytes["ring"] == sent["bwd"]
    assert (sent["fwd"] > 0) == (ring > 1) and k.grad is not None
