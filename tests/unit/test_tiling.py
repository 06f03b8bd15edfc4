"""Memory features, one process: chunked LM loss, tiled MLP, selective checkpoints, offload,
recomputed norms.

Each is exact (same loss and gradients as without) and each really removes the buffer it
promises to: a dispatch mode records the largest tensor any op makes in forward + backward.
"""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from usp.config import ModelConfig
from usp.attention import local_attention
from usp.models.decoder import FeedForward, RMSNorm, Transformer
from usp.models.families import builtin_model
from usp.models.offload import ActivationOffload
from usp.models.tiling import chunked_lm_loss, lm_loss, loss_share, tiled

LOCAL = functools.partial(local_attention, causal=True)
CFG = dict(vocab_size=256, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


class SavedForBackward:
    """Adds up the elements of every tensor autograd saves for backward while active (the
    activations a forward keeps alive; a checkpointed region saves through its own hooks,
    so what it recomputes is not counted)."""

    def __init__(self):
        self.numel = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.numel += t.numel()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _data(b=2, n=37, d=16, v=50, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(b, n, d, generator=gen, dtype=dtype)
    w = torch.randn(v, d, generator=gen, dtype=dtype) * 0.5
    y = torch.randint(0, v, (b, n), generator=gen)
    y[0, :12] = -100  # with chunk 10: the first chunk counts no token at all
    y[1, -3:] = -100
    return h, w, y


def _loss_and_grads(fn, h, w, y, scale=1.7):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, pred = fn(h, w, y)
    (loss * scale).backward()
    return loss.detach(), pred, h.grad, w.grad


def _full(h, w, y):
    return lm_loss(F.linear(h, w), y)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [10, 1, 74, 500])
def test_chunked_loss_matches_full_cross_entropy(dtype, chunk):
    h, w, y = _data(dtype=dtype)
    want = _loss_and_grads(_full, h, w, y)
    got = _loss_and_grads(lambda *a: chunked_lm_loss(*a, chunk), h, w, y)
    assert got[0].dtype == want[0].dtype and got[0].dim() == 0
    assert torch.equal(got[1], want[1]) and got[1].dtype == torch.long
    for name, g, ref in zip(("loss", "dh", "dW"), (got[0], got[2], got[3]),
                            (want[0], want[2], want[3])):
        assert _rel(g, ref) <= 1e-6, (name, _rel(g, ref))
    assert (got[2][0, :12] == 0).all()  # ignored tokens get no gradient
    # the reference itself: sum of per-token -log softmax at the label
    logp = torch.log_softmax(F.linear(h, w).double(), -1)
    keep = y != -100
    manual = -logp[keep].gather(-1, y[keep].unsqueeze(-1)).sum()
    assert abs(got[0].item() - manual.item()) <= 1e-5 * manual.item()


def test_chunked_loss_bf16_error_within_twice_the_unchunked():
    h, w, y = _data(b=2, n=300, d=64, v=512, dtype=torch.float64, seed=3)
    exact = _loss_and_grads(_full, h, w, y)
    hb, wb = h.bfloat16(), w.bfloat16()
    full = _loss_and_grads(_full, hb, wb, y)
    chunked = _loss_and_grads(lambda *a: chunked_lm_loss(*a, 64), hb, wb, y)
    for i, name in ((0, "loss"), (2, "dh"), (3, "dW")):
        err_full, err_chunk = _rel(full[i], exact[i]), _rel(chunked[i], exact[i])
        assert err_chunk <= 2 * err_full + 1e-7, (name, err_chunk, err_full)
    assert chunked[2].dtype == chunked[3].dtype == torch.bfloat16


def test_chunked_loss_never_makes_whole_logits():
    h, w, y = _data(b=2, n=40, d=16, v=256, dtype=torch.float32)
    full_logits = 2 * 40 * 256
    for fn, chunked in ((lambda *a: chunked_lm_loss(*a, 16), True), (_full, False)):
        with LargestTensor() as seen, SavedForBackward() as kept:
            _loss_and_grads(fn, h, w, y)
        assert (seen.numel < full_logits) == chunked, (seen.numel, full_logits)
        assert (kept.numel < full_logits) == chunked, (kept.numel, full_logits)
    with pytest.raises(ValueError, match="chunk >= 1"):
        chunked_lm_loss(h, w, y, 0)


def _model(seed=1, attn=LOCAL, **kw):
    model_kw = {k: kw.pop(k) for k in list(kw) if k in ModelConfig.__dataclass_fields__}
    m = Transformer(ModelConfig(**{**CFG, **model_kw}), attn, **kw)
    m.init_weights(seed)
    return m


def _batch(b=2, n=24, v=256, seed=5):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    labels = torch.randint(0, v, (b, n), generator=gen)
    labels[:, :5] = -100
    return tokens, labels


def _model_grads(model, tokens, labels, segment_ids=None):
    loss, pred = model(tokens, torch.arange(tokens.shape[1]), segment_ids, labels=labels)
    loss.backward()
    return loss.detach(), pred, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got, want, rel=1e-6):
    assert abs(got[0].item() - want[0].item()) <= rel * abs(want[0].item())
    assert torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        assert _rel(got[2][name], g) <= rel, (name, _rel(got[2][name], g))


@pytest.mark.parametrize("tie", [True, False])
def test_model_loss_chunk_and_mlp_tiles_are_exact(tie):
    tokens, labels = _batch()
    want = _model_grads(_model(tie_embeddings=tie), tokens, labels)
    # the labels path equals the logits path the trainer used before
    logits = _model(tie_embeddings=tie)(tokens, torch.arange(24))
    ref_loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    assert abs(ref_loss.item() - want[0].item()) <= 1e-6 * ref_loss.item()
    for kw in (dict(loss_chunk=7), dict(mlp_tiles=5), dict(norm_tiles=3),
               dict(loss_chunk=48, mlp_tiles=2, norm_tiles=4)):
        _assert_same(_model_grads(_model(tie_embeddings=tie, **kw), tokens, labels), want)


def test_tiled_mlp_matches_plain_and_keeps_one_tile():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 40, 8, generator=gen)  # [B, n, D]; F = 128 makes [B, n, F] the largest
    results = {}
    for tiles in (1, 3, 7):
        ff = FeedForward(8, 128, tiles)
        for p in ff.parameters():
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(p.numel()))
        xi = x.clone().requires_grad_()
        with LargestTensor() as seen:
            with SavedForBackward() as kept:
                out = ff(xi)
            out.pow(2).sum().backward()
        # forward keeps no [B, n, F] activation for backward when tiled: tiles recompute
        assert (kept.numel < 2 * 40 * 128) == (tiles > 1), (tiles, kept.numel)
        results[tiles] = (out.detach(), xi.grad, [p.grad for p in ff.parameters()], seen.numel)
        with torch.no_grad():  # eval: tiles run plainly, same values
            assert torch.allclose(ff(x), out, rtol=1e-6, atol=1e-7)
    plain = results[1]
    assert plain[3] >= 2 * 40 * 128  # the whole [B, n, F] intermediate exists untiled ...
    for tiles in (3, 7):
        out, dx, dws, largest = results[tiles]
        assert largest <= 2 * (40 // tiles + 1) * 128, (tiles, largest)  # ... one tile here
        assert _rel(out, plain[0]) <= 1e-6 and _rel(dx, plain[1]) <= 1e-6
        for g, ref in zip(dws, plain[2]):
            assert _rel(g, ref) <= 1e-6
    assert torch.equal(tiled(torch.sin, x, 100), torch.sin(x))  # more tiles than tokens


def _count_calls(model):
    calls = {"attention": [0] * len(model.layers), "mlp": [0] * len(model.layers)}
    for i, block in enumerate(model.layers):
        for part, mod in (("attention", block.attention), ("mlp", block.feed_forward)):
            mod.register_forward_pre_hook(
                lambda *_, part=part, i=i: calls[part].__setitem__(i, calls[part][i] + 1))
    return calls


@pytest.mark.parametrize("part", ["block", "attention", "mlp"])
def test_selective_checkpoints_are_exact_and_recompute_what_they_say(part):
    tokens, labels = _batch()
    segs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])  # packed documents too
    want = _model_grads(_model(mlp_tiles=3, loss_chunk=9), tokens, labels, segs)
    for every in (1, 2):
        model = _model(mlp_tiles=3, loss_chunk=9, checkpoint_activations=True,
                       checkpoint_every=every, checkpoint_part=part)
        calls = _count_calls(model)
        _assert_same(_model_grads(model, tokens, labels, segs), want)
        ckpt = [i % every == 0 for i in range(3)]
        for p in ("attention", "mlp"):
            again = [c and part in ("block", p) for c in ckpt]
            assert calls[p] == [2 if a else 1 for a in again], (every, part, p, calls)
    with pytest.raises(ValueError, match="checkpoint_part"):
        _model(checkpoint_activations=True, checkpoint_part="ffn")


class FakeCopier:
    """Plain host copies, with a log of what was copied when (tests the bookkeeping)."""

    def __init__(self):
        self.log, self.hosts, self.released = [], [], []

    def _index(self, host):
        return next(i for i, h in enumerate(self.hosts) if h is host)

    def to_host(self, t):
        self.hosts.append(t.clone())
        self.log.append(("to_host", len(self.hosts) - 1))
        return self.hosts[-1]

    def to_device(self, host, device):
        self.log.append(("to_device", self._index(host)))
        return host.clone().to(device), self._index(host)

    def wait(self, token):
        self.log.append(("wait", token))

    def release(self, host):
        self.released.append(self._index(host))


def test_offload_round_trip_prefetch_order_and_nothing_held():
    tokens, labels = _batch()
    want = _model_grads(_model(checkpoint_activations=True, mlp_tiles=2), tokens, labels)
    copier = FakeCopier()
    offload = ActivationOffload(copier)
    model = _model(checkpoint_activations=True, mlp_tiles=2, offload=offload)
    inputs, alive = [], []

    def keep_input(mod, args):
        if len(inputs) < 3:  # the first forward's block inputs
            inputs.append(args[0].detach().clone())
            alive.append(weakref.ref(args[0]))

    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(keep_input)
        block.attention.register_forward_pre_hook(  # compute, in the copier's log
            lambda *_, i=i: copier.log.append(("attention", i)))
    loss, pred = model(tokens, torch.arange(24), labels=labels)
    assert offload.held() == 3
    assert [a() for a in alive] == [None, None, None]  # forward kept no device copy
    for i in range(3):  # the host copy is the block input, bit for bit
        assert torch.equal(copier.hosts[i], inputs[i])
    loss.backward()
    got = (loss.detach(), pred, {n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in want[2].items():  # recompute from the returned copies: bit-identical
        assert torch.equal(got[2][name], g), name
    assert got[0].item() == want[0].item()
    # block 2 is recomputed first (fetched on demand); each recompute starts bringing back
    # the previous block's input before it computes, and only then waits for its own
    assert copier.log == [("to_host", 0), ("attention", 0), ("to_host", 1), ("attention", 1),
                          ("to_host", 2), ("attention", 2),
                          ("to_device", 2), ("wait", 2), ("to_device", 1), ("attention", 2),
                          ("wait", 1), ("to_device", 0), ("attention", 1),
                          ("wait", 0), ("attention", 0)]
    assert offload.held() == 0 and sorted(copier.released) == [0, 1, 2]
    # a second step starts afresh
    model.zero_grad()
    model(tokens, torch.arange(24), labels=labels)[0].backward()
    assert offload.held() == 0 and len(copier.hosts) == 6
    with pytest.raises(ValueError, match="checkpoint_activations"):
        _model(offload=ActivationOffload(FakeCopier()))


FAMILY_SHAPES = {  # a family each: plain, q/k norms, four norms a block, experts and sinks
    "llama": {},
    "qwen3": {"arch": "qwen3", "qk_norm": True},
    "gemma3_text": {"arch": "gemma3_text", "qk_norm": True, "query_pre_attn_scalar": 12,
                    "sliding_window": 5, "local_rope_theta": 100.0,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "gpt_oss": {"arch": "gpt_oss", "qkv_bias": True, "o_bias": True, "attention_sinks": True,
                "n_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 32,
                "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
}


@pytest.mark.parametrize("family", list(FAMILY_SHAPES))
def test_recomputed_norms_give_bit_identical_losses_and_gradients(family, monkeypatch):
    """RMSNorm recomputes itself in backward (``RMSNorm.recompute``): the same loss and
    gradients to the last bit as keeping its fp32 intermediates, in every family, alone, in a
    checkpointed block with MLP tiles and the chunked loss, and with offload."""
    tokens, labels = _batch()
    options = [{}, {"checkpoint_activations": True, "loss_chunk": 9, "mlp_tiles": 3},
               {"checkpoint_activations": True, "offload": ActivationOffload(FakeCopier())}]
    for kw in options:
        model_kw = {k: kw[k] for k in ("loss_chunk", "mlp_tiles") if k in kw}
        mc = ModelConfig(**{**CFG, "head_dim": 8, **FAMILY_SHAPES[family], **model_kw})
        runs = []
        for recompute in (True, False):
            monkeypatch.setattr(RMSNorm, "recompute", recompute)
            model = builtin_model(mc, LOCAL, **{k: v for k, v in kw.items() if k not in model_kw})
            with torch.no_grad():  # random norm weights too: ones would hide a swapped gain
                gen = torch.Generator().manual_seed(3)
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            runs.append(_model_grads(model, tokens, labels))
        (loss, pred, grads), (ref_loss, ref_pred, ref_grads) = runs
        assert loss.item() == ref_loss.item() and torch.equal(pred, ref_pred), (family, kw)
        for name, g in ref_grads.items():
            assert torch.equal(grads[name], g), (family, kw, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_recomputed_norm_keeps_only_its_input(dtype, monkeypatch):
    """Per token of width D autograd keeps the input (``a D`` bytes) and nothing of fp32,
    where the plain norm keeps the fp32 copy and normalised values and the fp32 rsqrt
    (``8 D + 4``); the output (which the next matmul keeps) is the same in both."""
    n, D = 10, 64
    x = torch.randn(1, n, D, dtype=dtype, requires_grad=True)
    norm = RMSNorm(D, 1e-5)
    kept = {}

    def pack(seen, t):
        if t.shape != (D,):  # the gain [D] is the same in both
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for recompute in (True, False):
        monkeypatch.setattr(RMSNorm, "recompute", recompute)
        seen = {}
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(pack, seen),
                                                      lambda t: t):
            norm(x)
        kept[recompute] = sum(seen.values())
    assert kept[True] == x.nbytes
    assert kept[False] == n * (8 * D + 4)  # fp32: the copy is x itself, 4 D of the 8 D

def test_gpu_offload_check_runs_on_cpu_with_plain_copies():
    from usp.bench.gpu_checks_training import check_offload

    row = check_offload(torch.device("cpu"), copier=FakeCopier())
    assert row["ok"] and row["grads_match"] and row["held_after_backward"] == 0
    assert row["peak_mb_offload"] is None  # memory is compared on CUDA only


def _run_cfg(model_kw=None, **trainer_kw):
    from usp.config import ParallelConfig, RecallData, RunConfig, TrainerConfig

    return RunConfig(model=ModelConfig(**(model_kw or {})),
                     parallel=ParallelConfig(ulysses_degree=2, ring_degree=2),
                     data=RecallData(seq_len=128), trainer=TrainerConfig(nprocs=4, **trainer_kw))


def test_preflight_refuses_offload_off_cuda_and_tiling_for_hf_models():
    from usp.run import check_hf_model, check_recompute, resolve_run

    ckpt = dict(activation_checkpointing=True)
    run = resolve_run(_run_cfg(**ckpt, checkpoint_every=2, checkpoint_part="mlp"), 4, "cpu")
    assert (run.ulysses, run.ring) == (2, 2)
    with pytest.raises(ValueError, match="activation_offload=true .* on cpu; set "
                                         "trainer.activation_offload=false") as e:
        resolve_run(_run_cfg(**ckpt, activation_offload=True), 4, "cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="state_offload=true .* on cpu; set "
                                         "trainer.state_offload=false") as e:
        resolve_run(_run_cfg(state_offload=True), 4, "cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="state_offload=true with model.pretrained=/ckpt: .* "
                                         "or unset model.pretrained"):
        check_recompute(_run_cfg({"pretrained": "/ckpt"}, state_offload=True), "cuda")
    for kw in (dict(loss_chunk=64), dict(mlp_tiles=2)):
        with pytest.raises(ValueError, match="model.hf=llama .* built-in model only"):
            check_hf_model(ModelConfig(hf="llama", **kw))
    with pytest.raises(ValueError, match="checkpoint_part=attention .* built-in model only"):
        resolve_run(_run_cfg(dict(hf="llama"), **ckpt, checkpoint_part="attention"), 4, "cpu")


def test_loss_share_sums_or_averages_to_the_global_mean():
    """Each rank's share of the global mean loss: the shares sum to it (ranks=1, gradients
    summed) or average to it (ranks=n, FSDP's averaged gradients)."""
    sums, counts = torch.tensor([3.0, 5.0, 0.5]), torch.tensor([2.0, 4.0, 1.0])
    count = counts.sum().double()
    mean = (sums.double().sum() / count).item()
    assert abs(sum(loss_share(s, count).item() for s in sums) - mean) < 1e-12
    n = len(sums)
    assert abs(sum(loss_share(s, count, n).item() for s in sums) / n - mean) < 1e-12
