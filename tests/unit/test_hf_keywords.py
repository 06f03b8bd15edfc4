"""Every decoder transformers ships whose attention passes a keyword outside usp's list is
refused by name, before any collective, or computes through usp what it computes unpatched.

The list: ``UspAttention``'s own parameters, ``NEUTRAL_KEYWORDS`` (any value) and
``UNSET_KEYWORDS`` (only None / False). The decoders are found by reading transformers'
modeling files for the keywords their ``attention_interface(...)`` calls pass, so a
transformers upgrade that adds one is in this test without editing it.
"""

import ast
import functools
import re
import inspect
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import usp
import usp.models.hf
from usp import SequenceLayout, SPMesh
from usp.dims.parallel import ParallelDims

L, V = 16, 128
MAX_PARAMS = 20_000_000  # a tiny model is far below; a default-sized part is far above
SIGNATURE = set(inspect.signature(usp.models.hf.UspAttention.__call__).parameters) - {
    "self", "module", "query", "key", "value", "kwargs"}
LISTED = SIGNATURE | set(usp.models.hf.NEUTRAL_KEYWORDS)
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, first_k_dense_replace=1,
            sliding_window=8, attention_dropout=0.0, use_cache=False)


@functools.cache
def _passed_keywords(folder: str) -> frozenset[str]:
    """Keywords of the ``attention_interface(...)`` calls in the modeling files of
    transformers' model folder ``folder``."""
    found = set()
    for path in (Path(transformers.__file__).parent / "models" / folder).glob("modeling_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "attention_interface"):
                found |= {k.arg for k in node.keywords if k.arg is not None}
    return frozenset(found)


@functools.cache
def _outside() -> dict[str, set[str]]:
    """Causal LM model type -> the keywords outside the list its attention passes."""
    out = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        extra = _passed_keywords(model_type_to_module_name(model_type)) - LISTED
        if extra:
            out[model_type] = extra
    return out


def _mesh(ulysses: int) -> SPMesh:
    """An SPMesh without a process group: a collective on it would fail, so whatever
    raises ValueError on it did so before any."""
    return SPMesh(ParallelDims(1, 1, ulysses), torch.arange(ulysses).reshape(1, 1, ulysses),
                  ["host"] * ulysses)


def _tiny(model_type: str):
    """A tiny model of ``model_type`` in eager attention, or None when the generic shape
    does not build one."""
    try:
        base = AutoConfig.for_model(model_type)
        kw = {k: v for k, v in TINY.items() if hasattr(base, k)}
        types = getattr(base, "layer_types", None)
        if types:  # one layer of each type
            kw["layer_types"] = list(dict.fromkeys(types))
            kw["num_hidden_layers"] = len(kw["layer_types"])
        if getattr(base, "pad_token_id", None) is not None:
            kw["pad_token_id"] = 0
        config = AutoConfig.for_model(model_type, **kw)
        with torch.device("meta"):  # parts the shape above does not reach may be full size
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            return None
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with torch.no_grad():
            model(input_ids=torch.randint(0, V, (1, L)))
    except Exception:  # noqa: BLE001 -- some configs need fields the generic shape lacks
        return None
    return model.eval()


def _raised_by_usp(e: BaseException) -> bool:
    """Whether ``e`` was raised in usp's code (a refusal), not in the model's."""
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(usp.__file__).parent in Path(tb.tb_frame.f_code.co_filename).parents


def _patched_logits(model, ulysses: int):
    mesh = _mesh(ulysses)
    layout = SequenceLayout(mesh, seq_len=L, balance="contiguous")
    usp.models.hf.patch(model, mesh, layout)
    ids = torch.arange(L)[None] % V
    batch = usp.models.hf.shard_batch(layout, input_ids=ids)
    with torch.no_grad():
        return model(**batch).logits


def _outcome(model_type: str, extra: set[str]) -> str:
    """"exact", "refused" (by patch or the first call) or, for a model the generic shape does
    not build, "refused by the function" (each of ``extra`` given to UspAttention)."""
    model = _tiny(model_type)
    if model is None:
        mesh = _mesh(2)
        attn = usp.models.hf.UspAttention(mesh, SequenceLayout(mesh, seq_len=L), (None,))
        q = torch.randn(1, 4, L // 2, 16)
        for key in extra:
            with pytest.raises(ValueError, match=f"passes {key}="):
                attn(torch.nn.Module(), q, q, q, None, **{key: torch.ones(4)})
        return "refused by the function"
    ids = torch.arange(L)[None] % V
    with torch.no_grad():
        want = model(input_ids=ids).logits
    try:
        got = _patched_logits(model, ulysses=1)
    except ValueError as e:
        said = str(e)
        assert _raised_by_usp(e), f"{model_type}: not usp's refusal: {said}"
        named = re.search(r"passes (\w+)= to attention", said)
        assert named is None or named.group(1) not in LISTED, said
        with pytest.raises(ValueError) as again:  # with SP: the same, before any collective
            _patched_logits(_tiny(model_type), ulysses=2)
        assert str(again.value) == said
        return "refused"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=model_type)
    return "exact"


@functools.cache
def _sink_decoders() -> list[str]:
    """Causal LM model types whose attention passes ``s_aux`` (per-head sinks)."""
    return [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            if "s_aux" in _passed_keywords(model_type_to_module_name(t))]


@functools.cache
def _outcomes() -> dict[str, str]:
    """``_outcome`` of every decoder the scans find: a keyword outside the list, or sinks
    (``s_aux``, which usp honours). Call it with ``get_rank`` patched (the tests do)."""
    types = sorted(set(_outside()) | set(_sink_decoders()))
    return {t: _outcome(t, _outside().get(t, set())) for t in types}


def test_the_scan_finds_the_decoders_that_pass_sinks():
    found = _outside()
    assert "gpt_oss" in _sink_decoders() and "s_aux" in SIGNATURE and "qwen3" not in found
    assert not any(k in LISTED for keys in found.values() for k in keys)


def test_every_decoder_with_a_keyword_outside_the_list_is_refused_or_exact(monkeypatch):
    # a one-rank mesh without a process group: this process is rank 0 of it
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    outcomes = _outcomes()
    built = [t for t, said in outcomes.items() if said != "refused by the function"]
    assert len(built) >= len(outcomes) // 2, outcomes  # most run as models
    # the harness itself: decoders that pass only listed keywords come out exact
    assert _outcome("qwen3", set()) == "exact" and _outcome("gemma3_text", set()) == "exact"


def test_every_decoder_that_passes_sinks_is_exact_or_refused(monkeypatch):
    # s_aux is honoured (usp_attention's sinks): gpt-oss computes through usp what it
    # computes unpatched, on one rank here and on several in test_hf_ranks
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    outcomes = {t: _outcomes()[t] for t in _sink_decoders()}
    assert outcomes["gpt_oss"] == "exact", outcomes


def test_gpt_oss_sinks_reach_usp_and_per_token_sinks_are_refused(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    from transformers import GptOssConfig, GptOssForCausalLM

    model = GptOssForCausalLM(GptOssConfig(**{k: v for k, v in TINY.items()
                                              if k not in ("moe_intermediate_size",)}))
    mesh = _mesh(2)
    attn = usp.models.hf.UspAttention(mesh, SequenceLayout(mesh, seq_len=L), (None, 8))
    q = torch.randn(1, 4, L // 2, 16)
    module = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="sinks=.*per token.*s_aux="):  # inkling2's
        attn(module, q, q, q, None, sinks=torch.zeros(1, 4, L // 2, 1))
    with pytest.raises(ValueError, match=r"sinks must be a floating tensor \[Hq\] = \[4\]"):
        attn(module, q, q, q, None, s_aux=module.sinks[:2])  # before any collective
    attn_ok = [k for k in ("sinks", "output_attentions", "past_key_values")]
    for key in attn_ok:  # unset: accepted (no collective reached: a 1-rank mesh)
        one = _mesh(1)
        out, _ = usp.models.hf.UspAttention(one, SequenceLayout(one, seq_len=L // 2), (None,))(
            module, q, q, q, None, **{key: None})
        assert out.shape == (1, L // 2, 4, 16)
