"""The resolver's first decision: the model's ``auto`` keys, from the data's vocabulary or the
checkpoint's config.json (``model.pretrained``).

A ``ModelConfig`` holds no ``auto``, so this decision is taken where the command line becomes
a typed config: ``usp.cli.to_config`` hands the ``model`` group's values (``auto`` allowed)
and the data here and types what comes back; the rest of the run's ``auto`` (degrees,
balance, all-to-all stages, device, batch) is ``resolve_run``'s, once the world is known.
``usp-train``, ``usp-eval`` and ``usp-plan`` (which prices the shape) all take this step."""

from __future__ import annotations

from ..config import MemmapData
from ..config.model import PLANNED_FIELDS
from ..data.dataset import AUTO, data_vocab
from ..models.pretrained import fill_model


def resolve_model(model: dict, data) -> dict:
    """The ``model`` group's values (``auto`` allowed) -> ``ModelConfig`` fields
    (``usp.models.pretrained.fill_model``): the data's metadata and a checkpoint's
    config.json, read before any process group; ValueError for an ``auto`` nothing fills,
    a set key the checkpoint contradicts, a vocabulary its embedding cannot hold."""
    vocab = data_vocab(data) if _reads_vocab(model, data) else None
    return fill_model(model, vocab)


def _reads_vocab(model: dict, data) -> bool:
    """The data's vocabulary is needed: ``vocab_size=auto``, or token files with a checkpoint
    read for ``auto`` keys (its embedding must cover them; the planner's ``auto`` keys,
    ``PLANNED_FIELDS``, read no checkpoint)."""
    if model["pretrained"] is not None:  # read with the checkpoint (a stated shape: neither)
        read = [v for k, v in model.items() if k not in PLANNED_FIELDS]
        return isinstance(data, MemmapData) and AUTO in read
    return model["vocab_size"] == AUTO
