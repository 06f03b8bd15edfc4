"""The model's attention routed through a ``SequenceLayout`` chosen per call: the built-in
model's attention function (``LayoutAttention``, its layout set by ``use``) and a
transformers model's ``use(layout)`` (``patch_layout``). Training routes it through each
batch's layout, evaluation through each scored length's. ``routed_model`` builds the model
so, the one place training (``usp.train.build.sharded_model``) and ``usp-eval``
(``usp.eval.runner.eval_model``) build it."""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from ..attention import usp_attention
from ..config import ModelConfig
from ..layout import SequenceLayout
from ..mesh import SPMesh
from .families import builtin_model


class LayoutAttention:
    """The built-in model's attention function, through ``layout`` (set by ``use``)."""

    def __init__(self, mesh: SPMesh, options: dict, layout: SequenceLayout | None = None):
        self.mesh, self.options, self.layout = mesh, options, layout

    def __call__(self, q, k, v, **masks):
        return usp_attention(q, k, v, mesh=self.mesh, layout=self.layout, causal=True,
                             **self.options, **masks)

    def use(self, layout: SequenceLayout) -> None:
        self.layout = layout


def patch_layout(patch, model, mesh: SPMesh, options: dict, layout: SequenceLayout) -> None:
    """A transformers model's ``use(layout)``: ``patch`` (``usp.models.hf.patch``) again."""
    patch(model, mesh, layout, **options)


def routed_model(mc: ModelConfig, mesh: SPMesh, options: dict, seed: int,
                 layout: SequenceLayout | None = None, checkpoint_activations: bool = False,
                 **blocks):
    """(model, its decoder layers, ``use(layout)``): ``mc``'s model, built alike on every
    rank, its attention through ``usp_attention`` on ``mesh`` with ``options``
    (``RunLayout.attention_options``) and ``layout`` (None: the first ``use`` sets it).

    The built-in model of ``mc``'s family (``usp.models.families``) with
    ``checkpoint_activations`` and ``blocks`` (``checkpoint_every``, ``checkpoint_part``,
    ``offload``), initialised by ``seed``; with ``mc.pretrained`` on the meta device
    instead, its weights read next (``usp.models.shard_load.load_shards``). For ``mc.hf``
    the transformers model (``usp.models.hf_model.build_model``: ``mc.pretrained``'s
    weights or an init by ``seed``), every layer checkpointed with
    ``checkpoint_activations``."""
    if mc.hf is None:
        attn = LayoutAttention(mesh, options, layout)
        # model.pretrained: built without weights, read into it once it is placed
        with torch.device("meta") if mc.pretrained else contextlib.nullcontext():
            model = builtin_model(mc, attn, checkpoint_activations=checkpoint_activations,
                                  **blocks)
        if mc.pretrained is None:
            model.init_weights(seed)
        return model, model.layers, attn.use
    from . import hf
    from .hf_model import build_model

    model = build_model(mc, seed)
    if checkpoint_activations:  # the same non-reentrant torch checkpoint
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if layout is not None:
        hf.patch(model, mesh, layout, **options)
    return model, model.model.layers, partial(patch_layout, hf.patch, model, mesh, options)
