"""The model families the built-in model serves: the one list, and the questions about a
model config that need it. Each family is its folder, ``usp/models/<name>/`` (its
``FAMILY``: ``usp.models.family.Family``); adding one is that folder, its entry in
``FAMILIES`` and its tests. Build, forward, evaluation, export, preflight, the CLI's model
schema and the tests ask here; nothing else names a family (``tests/unit/test_families.py``).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from ..config.checks import one_of
from . import gemma3, gemma3_text, gpt_oss, llama, mistral, qwen2, qwen3, qwen3_moe
from .decoder import Transformer
from .family import Family, windows

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, qwen2.FAMILY, mistral.FAMILY, qwen3.FAMILY,  # the built-in model computes
    gemma3_text.FAMILY, gemma3.FAMILY,  # ... on its own blocks (gemma3: the text model)
    qwen3_moe.FAMILY, gpt_oss.FAMILY)}  # ... a mixture of experts
# the families the built-in model computes (model=pretrained without model.hf, model.arch)
BUILTIN: dict[str, Family] = {name: f for name, f in FAMILIES.items() if f.builtin}
# those of the shared decoder: a built-in model without model.arch is one of them
SHARED: dict[str, Family] = {name: f for name, f in BUILTIN.items() if f.model is Transformer}
# the ModelConfig fields only some families hold (Family.holds)
HELD = tuple(dict.fromkeys(key for f in FAMILIES.values() for key in f.holds))


def family(name: str | None, key: str = "model.hf") -> Family:
    """The family ``name``; ValueError naming ``key`` and the families otherwise."""
    one_of(key, name, tuple(FAMILIES))
    return FAMILIES[name]


def check_model(mc: ModelConfig) -> None:
    """Refuse (ValueError) a ``model.arch`` or ``model.hf`` that is no family, and a shape its
    family cannot hold (a window on a Llama, ...). The CLI, ``usp.run.resolve_run`` and
    ``usp.models.pretrained.pretrained_config`` call it on every model config they accept."""
    if mc.arch is not None:
        family(mc.arch, "model.arch")
    if mc.hf is not None:
        hf = family(mc.hf)
        check_whole(hf, f"model.hf={hf.name}")
        _check_hf_shape(mc, hf)
        _check_holds(mc, hf, f"model.hf={hf.name}")
        hf.check_hf(mc)
    else:
        builtin_family(mc)  # its windows, biases and q/k norms


def check_whole(fam: Family, what: str) -> None:
    """Refuse (ValueError, saying ``what``) transformers' class of ``fam`` when a checkpoint of
    it holds a text model beside other parts (``Family.text_model``): that class is the whole
    model, and usp trains the text model only (the built-in model, exported as the text
    model's family)."""
    if fam.text_model is not None:
        text = fam.text_model.family
        raise ValueError(f"{what}: transformers' class of {fam.name} is the whole model, its "
                         f"text model beside {fam.text_model.others}, which usp does not "
                         f"compute; train the text model on the built-in model (model=pretrained "
                         f"model.pretrained=DIR without model.hf; it exports as {text}), or "
                         f"model.hf={text} from a {text} checkpoint")


def check_priced(mc: ModelConfig, what: str) -> None:
    """Refuse (ValueError) ``what`` (the planner's pricing) for a mixture of experts whose
    config does not state its experts: a family with experts (``Family.experts``: ``model.hf``
    of one, or the built-in one of ``model.arch``) with ``model.n_experts`` null (gpt-oss
    through ``model.hf``, whose family holds no expert fields). The planner prices the experts
    from ``n_experts``, ``experts_per_token``, ``expert_ffn_dim`` and ``sparse_layers``
    (``usp.planner.experts``)."""
    key = "model.hf" if mc.hf is not None else "model.arch"
    name = mc.hf if mc.hf is not None else mc.arch
    if name is not None and family(name, key).experts and mc.n_experts is None:
        raise ValueError(f"{what} prices a mixture of experts from model.n_experts, "
                         f"experts_per_token and expert_ffn_dim; {key}={name} is one, but its "
                         "config states no experts (model.n_experts=null: the family holds no "
                         "expert fields), so their weights and routing cannot be priced: set "
                         "parallel.ulysses_degree and parallel.ring_degree yourself")


def checkpoint_family(model_type: str | None, where: str = "the checkpoint") -> Family:
    """The family of a checkpoint whose config says ``model_type``; ValueError naming
    ``where`` and the families otherwise."""
    if model_type not in FAMILIES:
        hf_only = "".join(f" and {n}" for n in FAMILIES if n not in BUILTIN)
        raise ValueError(f"{where} is a {model_type!r} model; usp maps {', '.join(BUILTIN)} "
                         f"checkpoints onto its built-in model, and model.hf trains those"
                         f"{hf_only} as transformers' classes: usp-train cannot "
                         "train it. The library path patches any decoder transformers ships, "
                         "or refuses it by name (usp.models.hf.patch, docs/huggingface.md)")
    return FAMILIES[model_type]


def builtin_checkpoint(model_type: str | None, where: str = "the checkpoint") -> Family:
    """The family of a checkpoint the built-in model starts from (``model=pretrained``
    without ``model.hf``): ``checkpoint_family``, and ValueError naming ``model.hf`` for a
    family only transformers' class computes."""
    fam = checkpoint_family(model_type, where)
    if not fam.builtin:
        raise ValueError(f"{where} is a {fam.name!r} model, which the built-in model does not "
                         f"compute (it computes {', '.join(BUILTIN)}); add model.hf={fam.name} "
                         "to train transformers' class through usp's attention")
    return fam


def builtin_family(mc: ModelConfig) -> Family:
    """The family the built-in model of ``mc`` computes: ``model.arch`` (a run from a
    checkpoint), else a family of the shared decoder (``SHARED``; ``_shared_family``).
    A setting of ``HELD`` its family does not hold is refused."""
    if mc.arch is not None:
        arch = builtin_checkpoint(family(mc.arch, "model.arch").name, f"model.arch={mc.arch}")
        _check_qk_norm(mc, arch)
        _check_holds(mc, arch, f"model.arch={arch.name}")
        arch.check_arch(mc)
        return arch
    chosen = _shared_family(mc)
    _check_holds(mc, chosen, f"a built-in model without model.arch (exported as {chosen.name})")
    return chosen


def _shared_family(mc: ModelConfig) -> Family:
    """With q/k norms the family of the shared decoder that has them (``Family.qk_norm``),
    else the one its windows export as (``Family.exports``), or with q/k/v biases that
    family lacks the one that holds biases at any windows (``Family.biases``)."""
    if mc.qk_norm:
        normed = next(f for f in SHARED.values() if f.qk_norm)
        if mc.qkv_bias and not normed.biases:
            raise ValueError(f"model.qk_norm=true with model.qkv_bias=true: no family holds "
                             f"both ({normed.name} has q/k norms and no biases); set one false")
        return normed
    pattern = windows(mc)
    chosen = next(f for f in SHARED.values() if f.exports == pattern)
    if mc.qkv_bias and not chosen.biases:
        return next(f for f in SHARED.values() if f.biases)
    return chosen


def _check_holds(mc: ModelConfig, fam: Family, what: str) -> None:
    """Refuse a setting of ``HELD`` (``local_rope_theta``, ..., None or false unset) set on
    ``mc`` whose family
    ``fam`` does not hold it (its transformers config has no place for it)."""
    for key in HELD:
        if getattr(mc, key) not in (None, False) and key not in fam.holds:
            holders = [f.name for f in FAMILIES.values() if key in f.holds]
            raise ValueError(f"model.{key}={getattr(mc, key)} but {what} has no such setting; "
                             f"set model.{key}=null, or train a family that has it "
                             f"({', '.join(holders)}: model.arch from its checkpoint, or "
                             "model.hf)")


def _check_hf_shape(mc: ModelConfig, hf: Family) -> None:
    """``model.hf``: the transformers class decides its biases and q/k norms, so a
    ``qkv_bias`` or ``qk_norm`` asked of a class that has none is refused, not dropped."""
    for key, asked, has in (("qkv_bias", mc.qkv_bias, hf.biases),
                            ("qk_norm", mc.qk_norm, hf.qk_norm)):
        if asked and not has:
            what = "q/k/v biases" if key == "qkv_bias" else "q/k norms"
            fix = ("set model.hf to the checkpoint's architecture (its config.json's model_type)"
                   if mc.pretrained is not None else
                   f"set model.{key}=false, or a model.hf whose class has them")
            raise ValueError(f"model.hf={hf.name} has no {what} (model.{key}=true): {fix}")


def _check_qk_norm(mc: ModelConfig, arch: Family) -> None:
    """A run from a checkpoint of ``arch`` has q/k norms if and only if the family has."""
    if mc.qk_norm != arch.qk_norm:
        has = "normalises q and k per head" if arch.qk_norm else "has no q/k norms"
        raise ValueError(f"model.arch={arch.name} {has} (model.qk_norm="
                         f"{str(mc.qk_norm).lower()}); set model.qk_norm="
                         f"{str(arch.qk_norm).lower()}")


def exported_family(mc: ModelConfig) -> Family:
    """The family whose transformers class the export of the built-in model ``mc`` writes:
    ``builtin_family``, or for a checkpoint's text model beside other parts the text model's
    family (``Family.text_model``: a gemma3 run exports as gemma3_text)."""
    fam = builtin_family(mc)
    return fam if fam.text_model is None else FAMILIES[fam.text_model.family]


def hf_equivalent(mc: ModelConfig) -> ModelConfig:
    """``mc`` (a built-in model, ``hf=None``) as the ``model.hf`` config of the transformers
    architecture that computes the same function (``exported_family``): a family's windows
    as it writes them (none: no window kept).
    ``usp.models.hf_model.hf_config`` turns it into the transformers config."""
    if mc.hf is not None:
        raise ValueError(f"model.hf={mc.hf} is a transformers model already; it exports with "
                         "its own config (run_dir/hf_config), not through the built-in mapping")
    name, pattern = exported_family(mc).name, windows(mc)
    arch = None if mc.arch is None else name  # a model.hf is its own architecture
    if pattern == "none":
        return replace(mc, hf=name, arch=arch, sliding_window=None, full_attention_every=0,
                       layer_types=None)
    if pattern == "every":  # however full_attention_every / layer_types said it
        return replace(mc, hf=name, arch=arch, full_attention_every=0)
    return replace(mc, hf=name, arch=arch)


def hf_names(mc: ModelConfig) -> dict[str, str]:
    """Every parameter of the built-in model of ``mc`` -> its name in the transformers model
    of ``hf_equivalent(mc)`` (its family's state-dict adapter)."""
    return exported_family(mc).names(mc)


def zero_filled(mc: ModelConfig) -> list[str]:
    """The transformers weights of ``hf_equivalent(mc)`` the built-in model lacks that are
    exact at zero (Qwen2's q/k/v biases when the built-in model has none)."""
    return exported_family(mc).zero_filled(mc)


def export_notes(mc: ModelConfig) -> list[str]:
    """What the export of the built-in model ``mc`` tells its user beyond what it wrote: the
    parts of a checkpoint beside its text model (``Family.text_model``) not carried over."""
    fam = builtin_family(mc)
    if fam.text_model is None:
        return []
    return [f"model.arch={fam.name}: the export is its text model alone "
            f"({exported_family(mc).name}); {fam.text_model.others} of model.pretrained="
            f"{mc.pretrained} are not carried over (usp neither loads nor trains them): take "
            "them from that checkpoint"]


def builtin_model(mc: ModelConfig, attn_fn, **options):
    """The built-in model of ``mc``: its family's model class (``Family.model``) with
    attention ``attn_fn`` and ``options`` (``checkpoint_activations``, ``offload``, ...)."""
    return builtin_family(mc).model(mc, attn_fn, **options)


def is_builtin(model) -> bool:
    """``model`` is a built-in model of some family (FSDP keeps the class as a base)."""
    return isinstance(model, tuple({f.model for f in BUILTIN.values()}))
