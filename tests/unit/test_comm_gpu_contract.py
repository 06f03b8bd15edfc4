"""What the GPU path relies on, checked on CPU in one process: the comm clock, host staging
for gloo decided per backend, ring-flash-attn's byte accounting. On ranks:
``distributed/test_comm_gpu_contract_ranks.py``."""

import sys
import types

import pytest
import torch

from usp import CommStats
from usp.comm import clock_for, stage_through_host

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
