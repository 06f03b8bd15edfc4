"""Training batches: a synthetic long-range recall task and memory-mapped token files.

Both give ``batch(step, batch_per_dp_rank, dp_rank, dp_size, positions=None)`` ->
``(tokens, labels)``, long tensors [B, L] (or [B, len(positions)]), labels already shifted
on the global sequence (-100 = ignored), drawn deterministically from (seed, global sample
index) so the global batch does not depend on the dp split or the SP layout.
``packed_batch`` (same arguments) gives the same rows as a ``Batch`` that also carries each
token's document id and position inside its document (``usp.data.packing``).

The names below load on first use: ``usp-prepare`` (``usp.data.prepare``) needs no torch.
"""

from importlib import import_module

_EXPORTS = {"MemmapTokens": ".memmap", "TokenWriter": ".files", "data_paths": ".files",
            "docs_path": ".files", "tokenizer_dir": ".files", "IGNORE_INDEX": ".packing",
            "Batch": ".packing", "document_positions": ".packing", "RecallTask": ".synthetic",
            "answer_accuracy": ".synthetic"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
