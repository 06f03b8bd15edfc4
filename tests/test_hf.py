"""Hugging Face decoders through usp.models.hf: parity with the unpatched model, packed documents,
sliding windows, refusals, batch preparation and the checkpoint export round trip.

One spawn of 4 gloo ranks loops over (ulysses, ring, dp) in {(1,1,4), (2,1,2), (2,2,1),
(4,1,1), (1,4,1)} and Llama (GQA), Qwen2 (GQA, sliding window on layer 1 only) and Mistral
(GQA, sliding window on every layer): gathered logits within 1e-4 of the unpatched model
on the whole batch in one process, every parameter gradient (summed over dp x sp) within
1e-3 of its largest entry, and the summed loss shares equal to HF's own loss. Packed rows
(documents marked by position_ids resets) equal each document run alone. The same spawn
writes a usp checkpoint (usp.models.checkpoint) that ``test_export_round_trip`` exports.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

import usp.models.hf
from usp import SequenceLayout, SPMesh
from usp.models.export import export_checkpoint, save_config
from usp.launch import spawn_local
from usp.models.checkpoint import save_checkpoint

L, ROWS, V = 32, 4, 128
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=V, max_position_embeddings=256, use_cache=False)
LAYOUTS = [(1, 1, "zigzag"), (2, 1, "contiguous"), (2, 2, "zigzag"), (4, 1, "zigzag"),
           (1, 4, "contiguous")]


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    if kind == "qwen2":  # layer 0 full attention, layer 1 a window of 6
        return Qwen2ForCausalLM(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6,
                                            max_window_layers=1))
    return MistralForCausalLM(MistralConfig(**TINY, sliding_window=5))


def _packed_positions(gen) -> torch.Tensor:
    """[ROWS, L] positions restarting at each document: random lengths, one row whole, a
    boundary at 8 (a shard edge for every layout) in row 1."""
    rows = [torch.arange(L)]
    while len(rows) < ROWS:
        cuts = sorted(torch.randperm(L - 3, generator=gen)[:3].add(2).tolist())
        cuts = [c for i, c in enumerate(cuts) if i == 0 or c - cuts[i - 1] >= 2]
        bounds = [0] + cuts + [L]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    rows[1][8:] = torch.arange(L - 8)  # a boundary on a shard edge for every layout
    return torch.stack(rows)


def _reference(ref, ids, pos):
    """logits [ROWS, L, V] and mean loss of the unpatched model; packed rows: each document
    alone (its logits, and its targets counted in the mean)."""
    if pos is None:
        out = ref(input_ids=ids, labels=ids)
        return out.logits.detach(), out.loss
    logits, loss_sum, count = torch.empty(ROWS, L, V), 0.0, 0
    for b in range(ROWS):
        starts = (pos[b] == 0).nonzero().flatten().tolist() + [L]
        for a, e in zip(starts, starts[1:]):
            doc = ids[b:b + 1, a:e]
            out = ref(input_ids=doc, labels=doc if e - a > 1 else None)
            logits[b, a:e] = out.logits[0].detach()
            if e - a > 1:  # a one-token document has no target
                loss_sum = loss_sum + out.loss * (e - a - 1)
                count += e - a - 1
    return logits, loss_sum / count


def _case(mesh: SPMesh, balance: str, kind: str, packed: bool, seed: int):
    model = _model(kind)
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (ROWS, L), generator=gen)
    pos = _packed_positions(gen) if packed else None
    ref_logits, ref_loss = _reference(ref, ids, pos)
    ref_loss.backward()

    layout = SequenceLayout(mesh, seq_len=L, balance=balance)
    usp.models.hf.patch(model, mesh, layout)
    rows = slice(mesh.dp_rank * ROWS // mesh.dp, (mesh.dp_rank + 1) * ROWS // mesh.dp)
    batch = usp.models.hf.shard_batch(layout, input_ids=ids[rows], labels=ids[rows],
                               position_ids=None if pos is None else pos[rows])
    assert ("segment_ids" in batch) == packed
    out = model(**{k: v for k, v in batch.items() if k != "shift_labels"})
    loss, count = usp.models.hf.causal_lm_loss(out.logits, batch["shift_labels"], mesh)
    loss.backward()

    where = f"{kind} (u={mesh.ulysses}, r={mesh.ring}, dp={mesh.dp}, {balance}, packed={packed})"
    err = (layout.gather(out.logits.detach(), dim=1) - ref_logits[rows]).abs().max().item()
    assert err <= 1e-4, f"{where}: logits differ by {err:.2e}"
    dp_sp = mesh.group("dp_sp")
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp_sp)
    assert abs(total.item() - ref_loss.item()) <= 1e-5, f"{where}: loss {total} vs {ref_loss}"
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=dp_sp)  # each rank holds its tokens' share
        rel = ((g - rp.grad).abs().max() / rp.grad.abs().max()).item()
        assert rel <= 1e-3, f"{where}: grad of {name} off by {rel:.2e} (relative)"
    return model


def _save_a_checkpoint(model, mesh: SPMesh, run_dir: str) -> None:
    """One optimizer step (so the weights differ from any init), then the trainer's save."""
    for p in model.parameters():  # every rank takes the same step, as the trainer does
        dist.all_reduce(p.grad, group=mesh.group("dp_sp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(run_dir, 1, model, opt, sched)
    if dist.get_rank() == 0:
        save_config(model.config, run_dir)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   f"{run_dir}/expected_state.pt")


def _worker(run_dir: str) -> None:
    seed = 0
    for u, r, balance in LAYOUTS:
        with SPMesh.build(ulysses=u, ring=r) as mesh:
            for kind in ("llama", "qwen2", "mistral"):
                seed += 1
                model = _case(mesh, balance, kind, packed=False, seed=seed)
            if (u, r) in ((2, 2), (1, 4)):
                for kind in ("llama", "mistral"):
                    seed += 1
                    model = _case(mesh, balance, kind, packed=True, seed=seed)
            if (u, r) == (2, 2):
                _save_a_checkpoint(model, mesh, run_dir)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_run")
    spawn_local(_worker, 4, str(path))
    return path


def test_parity_over_layouts(run_dir):
    assert (run_dir / "checkpoints" / "step_000001" / "manifest.json").is_file()


def test_export_round_trip(run_dir, tmp_path):
    out_dir = tmp_path / "exported"
    export_checkpoint(run_dir, out_dir)  # the run's newest checkpoint and its hf_config
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir))
    assert (out_dir / "model.safetensors").is_file()
    expected = MistralForCausalLM(MistralConfig(**TINY, sliding_window=5))
    expected.load_state_dict(torch.load(run_dir / "expected_state.pt"))
    fresh = _model("mistral")
    assert type(loaded) is MistralForCausalLM
    ids = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, expected.eval()(input_ids=ids).logits
        init = fresh.eval()(input_ids=ids).logits
    assert torch.equal(got, want)
    assert not torch.allclose(init, want)  # the optimizer step moved the weights


# ---- one process, no process group: batches, windows and refusals -------------------------

def test_global_batch_shifts_on_the_global_row_and_cuts_at_documents():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    plain = usp.models.hf.global_batch(ids, labels=ids)
    assert torch.equal(plain["shift_labels"], torch.tensor([[11, 12, 13, 14, 15, -100]]))
    assert torch.equal(plain["position_ids"], torch.arange(6)[None])
    assert "segment_ids" not in plain
    # documents from position resets: [0 1 2][0 1][0]
    packed = usp.models.hf.global_batch(ids, labels=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert torch.equal(packed["shift_labels"], torch.tensor([[11, 12, -100, 14, -100, -100]]))
    assert torch.equal(packed["segment_ids"], torch.tensor([[1, 1, 1, 2, 2, 3]]))
    assert torch.equal(packed["position_ids"], torch.tensor([[0, 1, 2, 0, 1, 0]]))


def test_global_batch_from_attention_mask_documents_and_padding():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    mask = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]])  # row 0: two documents, a pad
    b = usp.models.hf.global_batch(ids, labels=ids, attention_mask=mask)
    assert torch.equal(b["shift_labels"], torch.tensor([[11, -100, 13, 14, -100, -100],
                                                        [21, 22, 23, 24, 25, -100]]))
    assert torch.equal(b["position_ids"], torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]))
    assert torch.equal(b["segment_ids"], torch.tensor([[1, 1, 2, 2, 2, 3], [1] * 6]))
    with pytest.raises(ValueError, match="must match input_ids"):
        usp.models.hf.global_batch(ids, labels=ids[:, :5])


def test_layer_windows_follow_the_config():
    assert usp.models.hf.layer_windows(LlamaConfig(**TINY)) == (None, None)
    assert usp.models.hf.layer_windows(MistralConfig(**TINY, sliding_window=5)) == (5, 5)
    qwen = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert usp.models.hf.layer_windows(qwen) == (None, 6)
    odd = LlamaConfig(**TINY)
    odd.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        usp.models.hf.layer_windows(odd)


def _fake_mesh(ulysses=2, ring=1):
    """An SPMesh with no process group: enough for every check that runs before one."""
    p = ulysses * ring
    return SPMesh(ulysses, ring, 1, "ulysses_inner", torch.arange(p).reshape(1, ring, ulysses),
                  ["host"] * p)


def test_patch_refuses_configs_it_cannot_compute():
    mesh = _fake_mesh()
    layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
    cases = [(dict(use_cache=True), "use_cache"),
             (dict(output_attentions=True), "output_attentions"),
             (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                    "rope_theta": 10000.0}), "rope_type"),
             (dict(attn_logit_softcapping=30.0), "softcapping")]
    for change, message in cases:
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **change}))
        with pytest.raises(ValueError, match=message):
            usp.models.hf.patch(model, mesh, layout)
        assert model.config._attn_implementation != f"usp_{id(model):x}"
    with pytest.raises(ValueError, match="different SPMesh"):
        usp.models.hf.patch(_model("llama"), _fake_mesh(), layout)
    with pytest.raises(ValueError, match="PreTrainedModel"):
        usp.models.hf.patch(torch.nn.Linear(2, 2), mesh, layout)


def test_patched_model_refuses_bad_calls_before_any_collective():
    mesh = _fake_mesh()
    layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
    model = _model("llama")
    usp.models.hf.patch(model, mesh, layout)
    ids = torch.randint(0, V, (2, L // 2))
    pos = torch.arange(L // 2).expand(2, -1)
    # no process group exists: a collective would raise RuntimeError, not these ValueErrors
    calls = [(dict(input_ids=torch.randint(0, V, (2, L))), "expects this rank's 16 tokens"),
             (dict(input_ids=ids), "position_ids missing"),
             (dict(input_ids=ids, position_ids=pos, use_cache=True), "use_cache"),
             (dict(input_ids=ids, position_ids=pos, labels=ids), "shift_labels"),
             (dict(input_ids=ids, position_ids=pos, output_attentions=True), "output_attentions"),
             (dict(input_ids=ids, position_ids=pos,
                   attention_mask=torch.ones_like(ids).index_fill(1, torch.tensor([15]), 0)),
              "segment_ids")]
    for kwargs, message in calls:
        with pytest.raises(ValueError, match=message):
            model(**kwargs)
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        model.train()(input_ids=ids, position_ids=pos)
    usp.models.hf.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert model(input_ids=torch.randint(0, V, (1, L))).logits.shape == (1, L, V)


def test_attention_function_refuses_what_it_cannot_honour():
    mesh = _fake_mesh()
    layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
    model = _model("mistral")
    attn = usp.models.hf.UspAttention(mesh, layout, usp.models.hf.layer_windows(model.config))
    module = model.model.layers[0].self_attn
    q = torch.randn(1, 4, L // 2, 16)
    kv = torch.randn(1, 2, L // 2, 16)
    cases = [(dict(attention_mask=torch.zeros(1, 1, 16, 16)), "no attention_mask"),
             (dict(attention_mask=None, dropout=0.1), "dropout"),
             (dict(attention_mask=None, softcap=50.0), "softcapping"),
             (dict(attention_mask=None, sliding_window=7), "sliding_window=7")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            attn(module, q, kv, kv, **kwargs)
