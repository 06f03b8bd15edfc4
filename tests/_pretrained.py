"""Tiny Hugging Face checkpoints written by transformers' own classes and ``save_pretrained``
(``unit/test_pretrained.py``, ``distributed/test_pretrained_ranks.py``): a Llama with Llama 3.1
``llama3`` scaling and its own head_dim, a Qwen2 with (non-zero) q/k/v biases, tied
embeddings and windowed layers after the first, a Mistral with a window on every layer, a
Qwen3 with q/k norms, a head_dim of its own (24, not 64 / 4) and a window on its last layer, a
Gemma 3 text model (a window on its local layers 0 and 2, an attention scale of its own, a
RoPE per layer type: its own bases, linear x 8 on the full layer), a Gemma 3 4B-27B layout
(``gemma3``: that text model, untied, beside a tiny SigLIP vision tower and its projector),
a Qwen3-MoE (8 experts, top 2, layer 1 dense), a gpt-oss (sinks, a band on layers 0 and 2,
YaRN, 8 experts with biases, top 2), and a gpt-oss's MXFP4 copy (``save_mxfp4``: the tests' own
e2m1 packer). Every norm weight is drawn away from its init."""

import functools
from pathlib import Path

import torch

from usp.attention import local_attention
from usp.models.families import BUILTIN, FAMILIES

# the built-in model's attention in one process: the torch kernel, and the reference one
# (which takes fp64 in backward too)
LOCAL = functools.partial(local_attention, causal=True)
REFERENCE = functools.partial(local_attention, causal=True, kernel="reference")

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=16)
# a RoPE per layer type, both unlike transformers' defaults: the sliding layers' base, the
# full ones' base and linear factor (Gemma 3 4B+)
GEMMA_ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=5000.0),
              "full_attention": dict(rope_type="linear", rope_theta=200000.0, factor=8.0)}
# each family's checkpoint (a family without one here fails its tests by name)
FAMILY_CONFIG = {
    "llama": dict(head_dim=32, rope_parameters=LLAMA3),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                  tie_word_embeddings=True),  # layer 0 full, layers 1 and 2 a window of 6
    "mistral": dict(sliding_window=5),
    "qwen3": dict(head_dim=24, use_sliding_window=True, sliding_window=6, max_window_layers=2),
    "qwen3_moe": dict(head_dim=24, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, mlp_only_layers=[1]),
    "gemma3_text": dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters=GEMMA_ROPE),
    # beside the gemma3_text model above (its text_config), untied: lm_head.weight of its own
    "gemma3": dict(vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=28, patch_size=14),
                   mm_tokens_per_image=4, image_token_index=127, boi_token_index=125,
                   eoi_token_index=126, tie_word_embeddings=False),
    "gpt_oss": dict(head_dim=16, sliding_window=6, num_local_experts=8, num_experts_per_tok=2,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=64)),
}
KINDS = tuple(BUILTIN)  # the families the built-in model serves
HF_ONLY = tuple(k for k in FAMILIES if k not in BUILTIN)  # transformers' class only (model.hf)


def hf_config(kind: str, **changes):
    """The transformers config of the family ``kind``'s checkpoint, with ``changes`` (keys of
    its config); a text model beside other parts (``Family.text_model``) is its text family's,
    under the key the family names."""
    import transformers

    fam = FAMILIES[kind]
    if fam.text_model is not None:
        text = hf_config(fam.text_model.family)
        return getattr(transformers, fam.config_class)(
            **{fam.text_model.config: text.to_dict()}, **FAMILY_CONFIG[kind])
    return getattr(transformers, fam.config_class)(**{**SHAPE, **FAMILY_CONFIG[kind], **changes})


def hf_model(kind: str, seed: int = 0, **changes):
    """A fresh transformers model of the family ``kind`` (fp32, ``hf_config(kind, **changes)``),
    its biases random too."""
    import transformers

    config = hf_config(kind, **changes)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):  # away from 0 / 1: a dropped one shows
                p.normal_(0.3, 0.2)
            if name.endswith(".sinks"):  # of the order of the scores, so that they matter
                p.normal_(0.0, 2.0)
    return model.eval()


def save_checkpoint(kind: str, path: Path, seed: int = 0, **changes) -> Path:
    hf_model(kind, seed, **changes).save_pretrained(path)
    return path


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the codes 0-7; 8-15 negative


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused expert weight w [E, C, R] (x @ w[e]) -> MXFP4 (blocks [E, R, C/32, 16] uint8,
    scales [E, R, C/32] uint8) as released gpt-oss checkpoints store it: each row of w^T in
    blocks of 32 under the smallest power of two that brings its largest magnitude to 6 or
    less, each value the nearest e2m1 code (the low nibble the even element)."""
    e, c, r = w.shape
    t = w.transpose(1, 2).reshape(e, r, c // 32, 32)  # [E, R, G, 32]
    exp = torch.ceil(torch.log2(t.abs().amax(-1) / 6)).clamp(min=-127)  # [E, R, G]
    scaled = t / torch.exp2(exp)[..., None]
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) | ((scaled < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # [E, R, G, 16]
    return blocks, (exp + 127).to(torch.uint8)


def save_mxfp4(ckpt: Path, out: Path, twin: Path | None = None) -> Path:
    """A copy at ``out`` of the gpt-oss checkpoint ``ckpt`` with its expert weights in MXFP4
    (``pack_mxfp4``; ``quantization_config`` mxfp4, as released checkpoints say); ``twin``: also
    the unquantized checkpoint whose expert weights are transformers' dequantization of those
    bytes (``convert_moe_packed_tensors``)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    quantized, dequantized = {}, {}
    for name, t in load_file(ckpt / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(t)
            quantized.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quantized[name] = dequantized[name] = t
    config = json.loads((ckpt / "config.json").read_text())
    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]  # released checkpoints' modules_to_not_convert
    mxfp4 = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": keep}}
    for path, tensors, extra in ((out, quantized, mxfp4), (twin, dequantized, {})):
        if path is not None:
            path.mkdir(parents=True)
            save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
            (path / "config.json").write_text(json.dumps({**config, **extra}))
    return out


def hf_logits(path: Path, tokens: torch.Tensor, rope_parameters: dict | None = None):
    """transformers' logits [B, L, V] of the checkpoint at ``path`` (fp32, eager attention),
    with its rope_parameters replaced when given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hc = AutoConfig.from_pretrained(path)
    if rope_parameters is not None:  # the text model's (Gemma 3's text_config)
        hc.get_text_config().rope_parameters = rope_parameters
    model = AutoModelForCausalLM.from_pretrained(path, config=hc, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def usp_logits(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """usp's logits [B, L, V] of the run's final checkpoint (the built-in model, one process)."""
    import functools
    import warnings

    import torch.distributed.checkpoint as dcp

    from usp.attention import local_attention
    from usp.models.checkpoint import latest_checkpoint
    from usp.models.families import builtin_model
    from usp.models.run_records import load_model_config

    model = builtin_model(load_model_config(run_dir),
                          functools.partial(local_attention, causal=True))
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": sd}, checkpoint_id=str(latest_checkpoint(run_dir)), no_dist=True)
    with torch.no_grad():
        return model.eval()(tokens, torch.arange(tokens.shape[1]))


def memory_features_agree(model, mc, options: dict, tokens: torch.Tensor,
                          positions: torch.Tensor) -> None:
    """In fp64 on the reference kernel: the built-in model of ``mc`` with ``options`` (model
    keys such as ``mlp_tiles`` or ``loss_chunk``; ``part``: activation checkpointing of that
    part) gives the plain model's loss (1e-12) and every gradient (1e-10 relative).
    ``model(mc, attn, **blocks)`` builds a model with the checkpoint's weights."""
    from dataclasses import replace

    import pytest

    options = dict(options)
    part = options.pop("part", None)
    blocks = dict(checkpoint_activations=True, checkpoint_part=part) if part else {}
    plain = model(mc, REFERENCE).double()
    other = model(replace(mc, **options), REFERENCE, **blocks).double()
    labels = torch.roll(tokens, -1, 1)
    losses = []
    for m in (plain, other):
        loss, _ = m(tokens, positions, labels=labels)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-12)
    for (name, p), q in zip(plain.named_parameters(), other.parameters()):
        assert float((q.grad - p.grad).abs().max() / p.grad.abs().max()) < 1e-10, name


def export_run(model, mc, root: Path) -> Path:
    """``model``'s weights, moved away from the checkpoint's (the run's own), as the step-1
    checkpoint of a one-process run directory ``root/run``, exported by ``usp-export`` to
    ``root/out``; returns ``root/out``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from usp.config import RecallData
    from usp.models.export import export_checkpoint
    from usp.models.run_records import save_data_record, save_model_config

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    run = root / "run"
    step = run / "checkpoints" / "step_000001"
    with warnings.catch_warnings():  # one process is assumed: it is meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    torch.save({"step": 1}, step / "extra.pt")
    save_model_config(mc, run)
    save_data_record(RecallData(seq_len=32, batch_per_dp_rank=1), run, None)
    export_checkpoint(run, root / "out")
    return root / "out"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference over the largest of ``b``."""
    return float((a - b).abs().max() / b.abs().max())


def checkpoint_model(mc, attn=LOCAL, **options):
    """The built-in model of ``mc`` (``options``: its activation checkpointing) holding the
    checkpoint's weights (``load_state``)."""
    from usp.models.families import builtin_model
    from usp.models.pretrained import load_state

    model = builtin_model(mc, attn, **options)
    model.load_state_dict(load_state(mc))
    return model


def hf_eager(path):
    """transformers' model of the checkpoint at ``path``, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager")


def transformers_agree(mc, model, hf, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """The built-in ``model`` of ``mc`` and transformers' ``hf`` (the same weights): logits and
    the summed loss within 1e-5 relative, every parameter's gradient (each of the built-in
    model's, by ``hf_names``) within 1e-5 of its largest entry."""
    from usp.models.families import hf_names

    labels = torch.roll(tokens, -1, 1)
    mine, _ = model(tokens, positions, labels=labels)
    theirs = hf(input_ids=tokens)
    with torch.no_grad():
        assert rel_err(model(tokens, positions), theirs.logits) < 1e-5
    want = torch.nn.functional.cross_entropy(theirs.logits.flatten(0, 1), labels.flatten(),
                                             reduction="sum")
    assert abs(mine.item() - want.item()) / want.item() < 1e-5
    mine.backward()
    want.backward()
    hf_params, params = dict(hf.named_parameters()), dict(model.named_parameters())
    assert len(hf_names(mc)) == len(params)
    for usp, name in hf_names(mc).items():
        assert rel_err(params[usp].grad, hf_params[name].grad) < 1e-5, usp


def rank_by_rank_load_agrees(mc) -> None:
    """``load_shards`` into a meta-device built-in model of ``mc`` (one process: all rows) gives
    ``load_state``'s weights exactly."""
    from usp.models.families import builtin_model
    from usp.models.pretrained import load_state
    from usp.models.shard_load import load_shards

    with torch.device("meta"):
        model = builtin_model(mc, LOCAL)
    load_shards(model, mc, "cpu")
    want = load_state(mc)
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())


def run_args(root: Path, name: str, ckpt: Path, seq_len: int, steps: int, extra=()) -> list[str]:
    """usp-train's arguments for a short run of the checkpoint ``ckpt`` on the token files
    ``root/corpus`` (and its ``.val`` split) at (2, 2), validated at its end (and step 0) on 4
    windows, writing ``root/name``; ``extra`` overrides follow."""
    return ["recipe=tiny_cpu", "model=pretrained", f"model.pretrained={ckpt}", "data=memmap",
            f"data.path={root / 'corpus'}", f"data.seq_len={seq_len}", "data.batch_per_dp_rank=2",
            "parallel.ulysses_degree=2", "parallel.ring_degree=2", f"trainer.steps={steps}",
            f"trainer.eval_every={steps}", "trainer.eval_windows=4", "optim.warmup_steps=1",
            "logging.wandb=disabled", "logging.plot=false", f"trainer.run_dir={root / name}",
            f"hydra.run.dir={root / 'hydra' / name}", *extra]


def hf_val_loss(root: Path, ckpt: Path, seq_len: int, rope=None, hf: str | None = None) -> float:
    """transformers' mean loss per target on the first 4 windows of ``root/corpus``'s
    validation split (``rope``: rope_parameters in place of the checkpoint's)."""
    import numpy as np
    import torch.nn.functional as F

    from usp.config import MemmapData
    from usp.data.dataset import build_validation
    from usp.models.pretrained import pretrained_config

    data = MemmapData(path=str(root / "corpus"), seq_len=seq_len, batch_per_dp_rank=2)
    (_, _, val), = build_validation(data, pretrained_config(ckpt, hf=hf), 4)
    b = val.model_windows(np.arange(4), torch.arange(seq_len))
    logits = hf_logits(ckpt, b.tokens, rope)
    return F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=-100).item()
