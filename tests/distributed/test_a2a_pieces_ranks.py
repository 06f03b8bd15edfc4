"""Messages cut into fragments (``SPMesh.build(fragment_bytes=...)``) and the crossing defaults,
on gloo ranks: fragmented exchanges return exactly what whole ones do (even and uneven blocks,
ulysses and ring), with the same bytes in more calls; ``usp_attention``'s default on a
mesh whose ulysses group crosses hosts pipelines and cuts messages, and stays
bit-identical to the explicit call."""

import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.comm import GLOO_FRAGMENT_BYTES, CommStats, all_to_all_start
from usp.launch import spawn_local
from usp.ulysses import all_to_all_v_start


def _exchanges():
    n, me = dist.get_world_size(), dist.get_rank()
    x = torch.arange(n * 1000, dtype=torch.float32).reshape(n, 1000) + 10_000 * me
    whole, cut = CommStats(), CommStats()
    a = all_to_all_start(x, None, None, whole).wait()
    b = all_to_all_start(x, None, None, cut, fragment_bytes=1024).wait()  # 4000 B per peer
    assert torch.equal(a, b)
    assert torch.equal(a[1 - me], torch.arange(1000.0) + 1000 * me + 10_000 * (1 - me))
    assert (whole.calls["ulysses"], cut.calls["ulysses"]) == (1, 4)
    assert whole.bytes == cut.bytes == {"ulysses": 4000}
    # uneven blocks: rank 0 sends 7 and 900 elements, rank 1 sends 300 and 5
    send_sizes = [[7, 900], [300, 5]][me]
    recv_sizes = [send_sizes[me] if j == me else [[7, 900], [300, 5]][j][me] for j in range(2)]
    send = torch.randn(sum(send_sizes))
    whole, cut = CommStats(), CommStats()
    a = all_to_all_v_start(send, send_sizes, recv_sizes, None, None, whole).wait()
    b = all_to_all_v_start(send, send_sizes, recv_sizes, None, None, cut,
                           fragment_bytes=1000).wait()  # largest block 3600 B: 4 fragments
    assert torch.equal(a, b)
    assert torch.equal(a[:recv_sizes[0]] if me == 0 else a[recv_sizes[0]:],
                       send[:7] if me == 0 else send[300:])  # the block kept at home
    assert (whole.calls["ulysses"], cut.calls["ulysses"]) == (1, 4)
    assert whole.bytes == cut.bytes


def _attention(mesh, lay, q, k, v, dout, **kw):
    ql, kl, vl = (lay.shard(t, dim=1).detach().requires_grad_() for t in (q, k, v))
    mesh.comm.reset()
    out = usp_attention(ql, kl, vl, mesh=mesh, layout=lay, **kw)
    out.backward(lay.shard(dout, dim=1))
    got = [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]
    return got, dict(mesh.comm.bytes), mesh.comm.calls["ulysses"]


def _defaults_and_fragments():
    inside = SPMesh.build(ulysses=2, ring=1, ranks_per_node=2)
    across = SPMesh.build(ulysses=2, ring=1, ranks_per_node=1)  # u=2 spans two "hosts"
    tiny = SPMesh.build(ulysses=2, ring=1, ranks_per_node=1, fragment_bytes=512)
    assert (inside.a2a_chunks, inside.fragment_bytes_for("ulysses")) == ("auto", None)
    assert across.ulysses_crosses_hosts and not across.crosses_hosts("ring")
    assert across.fragment_bytes_for("ulysses") == GLOO_FRAGMENT_BYTES
    g = torch.Generator().manual_seed(3)
    L, d = 64, 16
    for hq, hkv in ((8, 8), (8, 2), (6, 6)):  # 6/6 over u=2: 3 heads a rank, 3 stages
        q, dout = (torch.randn(1, L, hq, d, generator=g) for _ in range(2))
        k, v = (torch.randn(1, L, hkv, d, generator=g) for _ in range(2))
        stages = min(4, hq // 2)
        ref, ref_bytes, calls = _attention(inside, SequenceLayout(inside, L), q, k, v, dout)
        assert calls == 4  # inside a host: one stage, 2 exchanges each way
        got, nbytes, calls = _attention(across, SequenceLayout(across, L), q, k, v, dout)
        assert calls == 4 * stages  # across: pipelined by default; messages under 256 KiB
        assert nbytes == ref_bytes
        same, _, _ = _attention(across, SequenceLayout(across, L), q, k, v, dout,
                                a2a_chunks=stages)
        for a, b, c in zip(got, same, ref):
            assert torch.equal(a, b)  # the default is exactly the explicit call
            torch.testing.assert_close(a, c, atol=2e-6, rtol=1e-5)
        cut, cut_bytes, cut_calls = _attention(tiny, SequenceLayout(tiny, L), q, k, v, dout)
        assert cut_bytes == ref_bytes and cut_calls > calls  # the same bytes, more messages
        for a, b in zip(cut, got):
            assert torch.equal(a, b)  # cutting messages changes no bit
    for mesh in (inside, across, tiny):
        mesh.close()


def _ring_fragments(ring: int, window):
    """Ring messages in fragments (an exchange on the ring group) against whole P2P messages:
    the same bits, bytes and kernel calls, more ring calls; ``window`` makes the
    accumulators jump home over several ranks."""
    whole = SPMesh.build(ulysses=1, ring=ring, ranks_per_node=1, fragment_bytes=None)
    cut = SPMesh.build(ulysses=1, ring=ring, ranks_per_node=1, fragment_bytes=300)
    auto = SPMesh.build(ulysses=1, ring=ring, ranks_per_node=1)
    assert auto.fragment_bytes_for("ring") == GLOO_FRAGMENT_BYTES  # the ring crosses hosts
    assert auto.fragment_bytes_for("ulysses") is None  # no ulysses group to cross
    g = torch.Generator().manual_seed(5)
    L = 16 * ring
    q, dout = (torch.randn(2, L, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, L, 2, 8, generator=g) for _ in range(2))
    for balance in ("zigzag", "contiguous"):
        a, a_bytes, _ = _attention(whole, SequenceLayout(whole, L, balance), q, k, v, dout,
                                   window=window)
        a_calls = whole.comm.calls["ring"]
        b, b_bytes, _ = _attention(cut, SequenceLayout(cut, L, balance), q, k, v, dout,
                                   window=window)
        assert b_bytes == a_bytes and cut.comm.calls["ring"] > a_calls
        assert cut.comm.kernel_calls == whole.comm.kernel_calls
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for mesh in (whole, cut, auto):
        mesh.close()


def _world2():
    _exchanges()
    _defaults_and_fragments()
    _ring_fragments(2, None)
    dist.barrier()


def _world4():
    _ring_fragments(4, 20)  # contiguous: 2 hops of 3, the accumulator goes home 2 ranks back
    dist.barrier()


def test_pieces_and_crossing_defaults():
    spawn_local(_world2, 2)


def test_ring_pieces_world_4():
    spawn_local(_world4, 4)
