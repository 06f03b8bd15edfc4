"""usp_attention vs fp64 dense attention: out, dq, dk, dv, on 1-4 gloo processes.

Every (ulysses, ring) layout runs causal and non-causal, contiguous and zigzag, MHA,
GQA with fewer KV heads than the ulysses degree, and MQA, in fp32 (<= 2e-5) and bf16
(<= 2x the one-process bf16 kernel's error, with fp32 merges); see ``_cases.check_case``.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from usp import SPMesh
from usp.launch import spawn_local

from _cases import check_case, parity_worker

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def _cases(kernel="torch"):
    return [
        dict(batch=2, seq_len=64, hq=hq, hkv=hkv, d=16, causal=causal, balance=balance,
             dtype=dtype, kernel=kernel)
        for causal, balance, (hq, hkv), dtype in itertools.product(
            (True, False), ("contiguous", "zigzag"), HEADS.values(),
            (torch.float32, torch.bfloat16),
        )
    ]


@pytest.mark.parametrize("ulysses,ring", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_parity(ulysses, ring):
    spawn_local(parity_worker, ulysses * ring, ulysses, ring, _cases())


def _placement_worker():
    # the reference kernel, the ring_inner placement, and a host order that makes mesh
    # coordinates differ from process-group ranks (exercises the all-to-all reordering).
    # Each ulysses group but the second crosses hosts, so these run the crossing defaults:
    # 4 pipelined stages (8 query heads over u=2); the last also cuts messages into fragments.
    case = dict(batch=1, seq_len=32, hq=8, hkv=2, d=8, causal=True, balance="zigzag",
                dtype=torch.float32)
    for kw in (
        dict(ranks_per_node=2, placement="ring_inner"),
        dict(hosts=["b", "a", "a", "b"]),
        dict(hosts=["b", "a", "a", "b"], placement="ring_inner"),
        dict(hosts=["b", "a", "a", "b"], placement="ring_inner", fragment_bytes=100),
    ):
        mesh = SPMesh.build(ulysses=2, ring=2, **kw)
        for kernel in ("torch", "reference"):
            check_case(mesh, kernel=kernel, seed=7, **case)
    dist.barrier()


def test_parity_placements_and_reference_kernel():
    spawn_local(_placement_worker, 4)


class _NoMasks:
    """A kernel object that does not say it applies masks."""

    name = "plain"

    def forward(self, q, k, v, causal, scale):
        raise AssertionError("never called")

    backward = forward


MASK_REFUSALS = [  # (usp_attention keywords on a [1, 8, 8, 8] q, message)
    (dict(segment_ids=torch.zeros(1, 8)), r"segment_ids must be a LongTensor.*\.long\(\)"),
    (dict(segment_ids=torch.zeros(1, 32, dtype=torch.long)),
     r"segment_ids\(1, 32\) must be \[batch, local length\] = \[1, 8\].*layout\.shard"),
    (dict(segment_ids=torch.zeros(1, 8, dtype=torch.long, device="meta")),
     r"segment_ids are on meta but q is on cpu"),
    (dict(window=0), r"window=0: .*positive int"),
    (dict(window=-4), r"window=-4: .*positive int"),
    (dict(window=True), r"window=True: .*positive int"),
    (dict(window=2.5), r"window=2\.5: .*positive int"),
    (dict(window=4, kernel=_NoMasks()), r"kernel '_NoMasks' cannot apply window"),
    (dict(segment_ids=torch.zeros(1, 8, dtype=torch.long), kernel="flash_attn"),
     r"kernel 'flash_attn' cannot apply segment_ids.*kernel='torch'"),
    (dict(window=4, ring_impl="ring_flash_attn"),
     r"ring_impl='ring_flash_attn' cannot apply window.*ring_impl='usp'"),
]
SINK_REFUSALS = [
    (dict(sinks=torch.zeros(4)), r"sinks must be a floating tensor \[Hq\] = \[8\]"),
    (dict(sinks=torch.zeros(8), ring_impl="ring_flash_attn"),
     r"ring_impl='ring_flash_attn' cannot apply sinks.*ring_impl='usp'"),
]


def _shape_errors_worker():
    mesh = SPMesh.build(ulysses=4, ring=1)
    from usp import SequenceLayout, usp_attention

    lay = SequenceLayout(mesh, seq_len=32)

    def boom(*a, **k):
        raise AssertionError("a collective ran before validation")

    # this spawned process ends after the test
    for name in ("all_to_all_single", "all_gather", "all_gather_object", "batch_isend_irecv"):
        setattr(dist, name, boom)
    q = torch.randn(1, 8, 3, 8)  # 3 heads over ulysses 4
    k = torch.randn(1, 8, 1, 8)
    with pytest.raises(ValueError, match=r"ulysses degree \(4\) > query heads \(3\)"):
        usp_attention(q, k, k, mesh=mesh, layout=lay)
    with pytest.raises(ValueError, match=r"local sequence length 4 != seq_len/\(ring\*ulysses\)"):
        q4 = torch.randn(1, 4, 8, 8)
        usp_attention(q4, q4, q4, mesh=mesh, layout=lay)
    q8 = torch.randn(1, 8, 8, 8)
    for kw, msg in MASK_REFUSALS + SINK_REFUSALS:
        with pytest.raises(ValueError, match=msg):
            usp_attention(q8, q8, q8, mesh=mesh, layout=lay, **kw)
    dist.barrier()


def test_bad_shapes_raise_before_any_collective():
    spawn_local(_shape_errors_worker, 4)
