"""The model's attention routed through a ``SequenceLayout`` chosen per call: the built-in
model's attention function (``LayoutAttention``, its layout set by ``use``) and a
transformers model's ``use(layout)`` (``patch_layout``). Training routes it through each
batch's layout, evaluation through each scored length's."""

from __future__ import annotations

from ..attention import usp_attention
from ..layout import SequenceLayout
from ..mesh import SPMesh


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
