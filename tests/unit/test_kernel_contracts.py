"""The local kernels' CUDA contracts, on CPU (issue 9: defects 1, 2 and 8).

``TorchKernel``'s CUDA branch runs against stand-ins of the four aten ops
(``fakes_cuda_ops``) and ``FlashAttnKernel`` against stand-in flash-attn packages of each
version (``fakes_flash_attn``): both refuse what the real ops refuse and compute in fp64,
so values are checked against dense fp64 attention too.
"""

import inspect

import pytest
import torch

import fakes_flash_attn
from _cases import TOL, dense_reference, document_ids
from fakes_cuda_ops import FakeCudaOps
from usp.compat import CudaSdpaOps, cuda_sdpa_ops, op_params
from usp.kernels import get_kernel
from usp.kernels.aten import TorchKernel
from usp.kernels.reference import ReferenceKernel
from usp.masks import BlockMask
from usp.ring import RingPlan, merge

B, D = 2, 16
SCALE = D**-0.5  # dense_reference's scale
HEADS = [(8, 8), (8, 2), (4, 1)]
LENS = [33, 100]
DTYPES = [torch.bfloat16, torch.float32]  # CUDA: the flash op, the efficient op


def _inputs(s, hq, hkv, dtype, seed=0):
    """q, k, v, dout [B, S, H, d] in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, s, h, D, generator=g).to(dtype) for h in (hq, hkv, hkv, hq)]


def _assert_close(got, want, dtype):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        err = (g.double() - w).abs().max().item()
        assert err <= TOL[dtype], (name, err, TOL[dtype])


def _run_pieces(kern, q, k, v, dout, pieces):
    """Attention of one block as the given planned calls (``usp.masks.Piece``s): forward
    merged by LSE, backward from the merged out/lse, with the slices the ring passes
    (q[:, qs], kv[0][:, ks], out[:, qs], lse[:, :, qs]). -> out, dq, dk, dv."""
    kv = torch.stack([k, v])  # [2, B, S, Hkv, d], as the ring carries K/V
    out = torch.zeros(q.shape)
    lse = torch.full((B, q.shape[2], q.shape[1]), float("-inf"))
    for p in pieces:
        blk_out, blk_lse = kern.forward(q[:, p.qs], kv[0][:, p.ks], kv[1][:, p.ks], p.causal,
                                        SCALE, mask=p.mask)
        merge(out[:, p.qs], lse[:, :, p.qs], blk_out, blk_lse)
    out = out.to(q.dtype)
    dq, dkv = torch.zeros(q.shape), torch.zeros(kv.shape)
    for p in pieces:
        dq_b, dk_b, dv_b = kern.backward(dout[:, p.qs], q[:, p.qs], kv[0][:, p.ks],
                                         kv[1][:, p.ks], out[:, p.qs], lse[:, :, p.qs],
                                         p.causal, SCALE, mask=p.mask)
        dq[:, p.qs] += dq_b
        dkv[0][:, p.ks] += dk_b
        dkv[1][:, p.ks] += dv_b
    return out, dq, dkv[0], dkv[1]


def _ring_pieces(kern, q, k, v, dout, causal, window=None, ids=None):
    """The diagonal block cut as the ring's backward cuts it (odd halves for odd S)."""
    plan = RingPlan(0, 1, q.shape[1], causal, "contiguous", window, ids, tile=8)
    return _run_pieces(kern, q, k, v, dout, sum(plan.diagonal_split(), []))


# ---- the stand-ins are the real ops' contracts ----------------------------------------------


@pytest.mark.parametrize("field", CudaSdpaOps._fields)
def test_stand_ins_have_the_real_schemas(field):
    """Positional order, keyword names, keyword-only ``scale`` and defaults as torch's schema."""
    args = getattr(cuda_sdpa_ops(), field).default._schema.arguments
    params = list(inspect.signature(getattr(FakeCudaOps(), field)).parameters.values())
    assert [p.name for p in params] == [a.name for a in args]
    assert [p.kind == p.KEYWORD_ONLY for p in params] == [a.kwarg_only for a in args]
    assert [p.default is not p.empty for p in params] == [a.has_default_value() for a in args]


def _valid_call(op):
    """Keyword arguments the stand-in ``op`` accepts: s = 33, Hq = 4, Hkv = 2 (flash)."""
    s, hq, hkv = 33, 4, 2
    if op.startswith("flash"):
        q, k, v, do = (t.transpose(1, 2) for t in _inputs(s, hq, hkv, torch.bfloat16))
        kw = dict(query=q, key=k, value=v, is_causal=True)
        if op == "flash_backward":
            kw.update(grad_out=do, out=do, logsumexp=torch.zeros(B, hq, s), cum_seq_q=None,
                      cum_seq_k=None, max_q=s, max_k=s, dropout_p=0.0,
                      philox_seed=torch.empty(2, dtype=torch.uint64),
                      philox_offset=torch.empty((), dtype=torch.uint64))
        return kw
    q, k, v, do = (t.transpose(1, 2) for t in _inputs(s, hq, hq, torch.float32))
    kw = dict(query=q, key=k, value=v, attn_bias=None, is_causal=True)
    if op == "efficient":
        kw.update(compute_log_sumexp=True)
    else:
        kw.update(grad_out_=do, out=do, logsumexp=torch.zeros(B, hq, 64),
                  philox_seed=torch.empty((), dtype=torch.int64),
                  philox_offset=torch.empty((), dtype=torch.int64), dropout_p=0.0,
                  grad_input_mask=[True, True, True, False])
    return kw


REFUSALS = [  # (op, change to a valid call, the CUDA op's complaint)
    # the old TorchKernel.backward's call: 0-element cum_seq selects the varlen path
    ("flash_backward", lambda a: dict(cum_seq_q=torch.empty(0), cum_seq_k=torch.empty(0)),
     "cu_seqlens_q must have dtype int32"),
    # ... and its philox seed/offset, not what the forward returned
    ("flash_backward", lambda a: dict(philox_seed=torch.zeros(2, dtype=torch.int64),
                                      philox_offset=torch.empty(0)),
     "as the flash forward returned"),
    ("flash_backward", lambda a: dict(logsumexp=torch.zeros(B, 40, 4).transpose(1, 2)[:, :, :33]),
     "softmax_lse must be a contiguous"),
    ("flash", lambda a: {n: a[n].float() for n in ("query", "key", "value")},
     "only support fp16 and bf16"),
    ("flash", lambda a: dict(query=a["query"][..., :12], key=a["key"][..., :12],
                             value=a["value"][..., :12]), "multiple of 8"),
    ("efficient", lambda a: dict(key=a["key"][:, :2], value=a["value"][:, :2]),
     "equal head counts"),
    ("efficient_backward", lambda a: dict(logsumexp=torch.zeros(B, 4, 33)),
     r"LSE is not correctly aligned \(strideH\)"),
    ("efficient_backward", lambda a: dict(out=a["out"].contiguous()), "out rows must be dense"),
    # attn_bias: rows of 33 fp32 elements are not 16-byte aligned (sdpa pads them to 48)
    ("efficient", lambda a: dict(attn_bias=torch.zeros(B, 4, 33, 33)), "not correctly aligned"),
    ("efficient", lambda a: dict(attn_bias=torch.zeros(B, 4, 33, 48)[..., :33].bfloat16()),
     "invalid dtype for bias"),
    ("efficient", lambda a: dict(attn_bias=torch.zeros(1, 1, 33, 48)[..., :33]),
     r"attn_bias: wrong shape \(batch dimension\)"),
    ("efficient_backward", lambda a: dict(attn_bias=torch.zeros(B, 4, 33, 48)[..., :32]),
     r"attn_bias: wrong shape \(seqlenKV dimension\)"),
]


@pytest.mark.parametrize("op", CudaSdpaOps._fields)
def test_stand_ins_accept_a_valid_call(op):
    getattr(FakeCudaOps(), op)(**_valid_call(op))


@pytest.mark.parametrize("op,change,msg", REFUSALS)
def test_stand_ins_refuse_what_the_cuda_ops_refuse(op, change, msg):
    kw = _valid_call(op)
    kw.update(change(kw))
    with pytest.raises(RuntimeError, match=msg):
        getattr(FakeCudaOps(), op)(**kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_branch_calls_fit_the_real_aten_schemas(dtype):
    """The real aten ops on meta tensors (their schemas and meta kernels) accept the CUDA
    branch's calls, None cum_seq and attn_bias included, and give the right shapes."""
    q, k, v, dout = (t.to("meta") for t in _inputs(33, 8, 2, dtype))
    kern = TorchKernel()  # meta is not "cpu": the CUDA branch with the real ops
    out, lse = kern.forward(q, k, v, True, SCALE)
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, True, SCALE)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (B, 8, 33), torch.float32)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# ---- TorchKernel's CUDA branch (defects 1 and 8) ------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("s", LENS)
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_branch_matches_fp64(dtype, hq, hkv, s, causal):
    fake = FakeCudaOps()
    kern = TorchKernel(cuda_ops=fake.ops())
    q, k, v, dout = _inputs(s, hq, hkv, dtype)
    out, lse = kern.forward(q, k, v, causal, SCALE)
    grads = kern.backward(dout, q, k, v, out, lse, causal, SCALE)
    _assert_close((out, *grads), dense_reference(q, k, v, dout, causal), dtype)
    want_lse = ReferenceKernel().forward(q.double(), k.double(), v.double(), causal, SCALE)[1]
    assert lse.dtype == torch.float32 and lse.shape == (B, hq, s)
    assert (lse.double() - want_lse).abs().max().item() < 1e-5
    # GQA: the flash op takes the Hkv heads as they are; the efficient op needs them expanded
    flash = dtype == torch.bfloat16
    want = {("flash", hq, hkv), ("flash_backward", hq, hkv)} if flash else \
        {("efficient", hq, hq), ("efficient_backward", hq, hq)}
    assert set(fake.calls) == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("s", LENS)
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_branch_on_the_ring_slices(dtype, hq, hkv, s, causal):
    kern = TorchKernel(cuda_ops=FakeCudaOps().ops())
    q, k, v, dout = _inputs(s, hq, hkv, dtype)
    got = _ring_pieces(kern, q, k, v, dout, causal)
    _assert_close(got, dense_reference(q, k, v, dout, causal), dtype)


def test_efficient_backward_takes_out_in_any_layout():
    """The efficient backward assumes out's rows are dense [B, S, H, d] without checking."""
    kern = TorchKernel(cuda_ops=FakeCudaOps().ops())
    q, k, v, dout = _inputs(33, 4, 2, torch.float32)
    out, lse = kern.forward(q, k, v, True, SCALE)
    out_bhsd = out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, H, S, d] memory
    grads = kern.backward(dout, q, k, v, out_bhsd, lse, True, SCALE)
    _assert_close((out, *grads), dense_reference(q, k, v, dout, True), torch.float32)


# ---- FlashAttnKernel per flash-attn version (defect 2) ------------------------------------


def test_custom_op_parameters_come_from_the_schema():
    """flash-attn >= 2.7's ops are CustomOpDefs: inspect sees (*args, **kwargs)."""
    fwd = fakes_flash_attn._fwd_27
    assert set(inspect.signature(fwd).parameters) == {"args", "kwargs"}
    assert {"window_size_left", "window_size_right", "softcap"} <= op_params(fwd)
    assert "window_size" in op_params(fakes_flash_attn._fwd_25)


@pytest.mark.parametrize("version", fakes_flash_attn.VERSIONS)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_kernel_per_version(monkeypatch, version, hq, hkv, causal):
    fakes_flash_attn.install(monkeypatch, version)
    kern = get_kernel("flash_attn")
    q, k, v, dout = _inputs(33, hq, hkv, torch.bfloat16)
    out, lse = kern.forward(q, k, v, causal, SCALE)
    assert lse.dtype == torch.float32 and lse.shape == (B, hq, 33)
    ref = dense_reference(q, k, v, dout, causal)
    grads = kern.backward(dout, q, k, v, out, lse, causal, SCALE)
    _assert_close((out, *grads), ref, torch.bfloat16)
    _assert_close(_ring_pieces(kern, q, k, v, dout, causal), ref, torch.bfloat16)


# ---- masks: the efficient op's attn_bias, flash-attn's window_size --------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_branch_with_masks_matches_fp64(dtype, hq, hkv, causal):
    """Masked calls go to the efficient op with an aligned [B, Hq, S, Sk] bias in q's dtype
    (the stand-in enforces the CUDA checks), in bf16 too; values as fp64 masked attention."""
    fake = FakeCudaOps()
    kern = TorchKernel(cuda_ops=fake.ops())
    q, k, v, dout = _inputs(33, hq, hkv, dtype)
    ids = document_ids(B, 33, torch.Generator().manual_seed(1), edge=8)
    for window, seg in ((5, None), (12, ids), (None, ids)):
        got = _ring_pieces(kern, q, k, v, dout, causal, window, seg)
        _assert_close(got, dense_reference(q, k, v, dout, causal, seg, window), dtype)
    assert ("efficient", hq, hq) in fake.calls and ("efficient_backward", hq, hq) in fake.calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_branch_rows_without_keys(dtype):
    """The stand-in's rows without a key are NaN: the adapter returns out 0, LSE -inf."""
    kern = TorchKernel(cuda_ops=FakeCudaOps().ops())
    q, k, v, _ = _inputs(20, 4, 2, dtype)
    seg = torch.zeros(B, 20, 20, dtype=torch.bool)
    seg[:, 5:, :9] = True  # rows 0..4 see nothing
    out, lse = kern.forward(q, k, v, False, SCALE, mask=BlockMask(30, 0, 20, 20, None, None, seg))
    assert not out.isnan().any() and (out[:, :5] == 0).all()
    assert (lse[..., :5] == float("-inf")).all() and lse[..., 5:].isfinite().all()


@pytest.mark.parametrize("version", fakes_flash_attn.VERSIONS)
def test_flash_attn_kernel_windows_per_version(monkeypatch, version):
    """Window pieces reach flash-attn as its own window_size; documents are refused."""
    fakes_flash_attn.install(monkeypatch, version)
    kern = get_kernel("flash_attn")
    q, k, v, dout = _inputs(33, 8, 2, torch.bfloat16)
    for causal, window in ((True, 5), (True, 17), (False, 6)):
        got = _ring_pieces(kern, q, k, v, dout, causal, window)
        _assert_close(got, dense_reference(q, k, v, dout, causal, None, window), torch.bfloat16)
    docs = BlockMask(0, 0, 33, 33, None, None, torch.ones(B, 33, 33, dtype=torch.bool))
    with pytest.raises(ValueError, match="not segment_ids.*kernel='torch'"):
        kern.forward(q, k, v, False, SCALE, mask=docs)
