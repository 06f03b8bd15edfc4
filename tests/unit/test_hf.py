"""Hugging Face decoders through usp.models.hf, one process: batch preparation, layer
windows, and refusals of configs and calls before any collective. Parity over layouts and
the export round trip: ``distributed/test_hf_ranks.py``."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

import usp.models.hf
from usp import SequenceLayout, SPMesh
from usp.dims.parallel import ParallelDims

from _hf_tiny import L, TINY, V, tiny_model


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
    return SPMesh(ParallelDims(1, ring, ulysses), torch.arange(p).reshape(1, ring, ulysses),
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
        usp.models.hf.patch(tiny_model("llama"), _fake_mesh(), layout)
    with pytest.raises(ValueError, match="PreTrainedModel"):
        usp.models.hf.patch(torch.nn.Linear(2, 2), mesh, layout)


def test_patched_model_refuses_bad_calls_before_any_collective():
    mesh = _fake_mesh()
    layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
    model = tiny_model("llama")
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


def test_position_ids_that_restart_need_segment_ids(monkeypatch):
    """transformers reads a restart of position_ids as a packed document's start and masks
    there; usp sees documents only through segment_ids, so a restart without them is refused
    (before this, attention silently crossed the documents)."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    one = _fake_mesh(ulysses=1)
    model = tiny_model("llama").eval()
    usp.models.hf.patch(model, one, SequenceLayout(one, seq_len=L))
    ids = torch.randint(0, V, (1, L))
    packed = torch.cat([torch.arange(20), torch.arange(L - 20)])[None]
    with pytest.raises(ValueError, match="position_ids restart or jump inside a row"):
        model(input_ids=ids, position_ids=packed)
    batch = usp.models.hf.shard_batch(SequenceLayout(one, seq_len=L), input_ids=ids,
                                      position_ids=packed)  # gives segment_ids: exact
    got = model(**batch).logits
    usp.models.hf.unpatch(model, to="eager")
    want = model(input_ids=ids, position_ids=packed).logits  # transformers masks there
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    usp.models.hf.patch(model, one, SequenceLayout(one, seq_len=L))
    assert model(input_ids=ids, position_ids=torch.arange(L)[None] + 7).logits.shape[1] == L
    two = _fake_mesh(ulysses=2)  # with SP: the global index, 0 .. L-1, and nothing else
    layout = SequenceLayout(two, seq_len=L, balance="zigzag")
    usp.models.hf.patch(model, two, layout)
    with pytest.raises(ValueError, match="or pass the global index"):
        model(input_ids=ids[:, :L // 2], position_ids=layout.shard(torch.arange(L)[None] + 7))


def test_attention_function_refuses_what_it_cannot_honour():
    mesh = _fake_mesh()
    layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
    model = tiny_model("mistral")
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
