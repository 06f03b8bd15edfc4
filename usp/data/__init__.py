"""Training batches: a synthetic long-range recall task and memory-mapped token files.

Both give ``batch(step, batch_per_dp_rank, dp_rank, dp_size, positions=None)`` ->
``(tokens, labels)``, long tensors [B, L] (or [B, len(positions)]), labels already shifted
on the global sequence (-100 = ignored), drawn deterministically from (seed, global sample
index) so the global batch does not depend on the dp split or the SP layout.
``packed_batch`` (same arguments) gives the same rows as a ``Batch`` that also carries each
token's document id and position inside its document (``usp.data.packing``).
"""

from .memmap import MemmapTokens, TokenWriter, data_paths, docs_path
from .packing import IGNORE_INDEX, Batch, document_positions
from .synthetic import RecallTask, answer_accuracy

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "MemmapTokens",
    "RecallTask",
    "TokenWriter",
    "answer_accuracy",
    "data_paths",
    "docs_path",
    "document_positions",
]
