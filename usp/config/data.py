"""``configs/data``: one dataclass per dataset, the option ``configs/data/<kind>.yaml`` of the
same name; ``DATA_KINDS`` maps ``data.kind`` to it. Each dataclass's defaults are that
option's values, except what the option file sets.

``batch_per_dp_rank`` is sequences per data-parallel rank per step; a step's global batch is
``global_batch(dp)`` = ``batch_per_dp_rank * dp``.

``packing`` says what the model sees of the documents in a row: ``none``, the row is one
sequence (attention and RoPE span it whole); ``documents``, each token attends only within
its document, labels crossing a boundary are ignored, and ``model.rope=per_document``
restarts RoPE positions at each document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .checks import at_least, one_of

PACKINGS = ("none", "documents")


class _Batches:
    """What every dataset config shares: its kind, sequence length, batch per dp rank and
    packing."""

    kind: str
    seq_len: int
    batch_per_dp_rank: int
    packing: str

    def global_batch(self, dp: int) -> int:
        """Sequences per step over all ``dp`` data-parallel ranks."""
        return self.batch_per_dp_rank * dp

    def _check(self, kind: str) -> None:
        if self.kind != kind:
            raise ValueError(f"data.kind={self.kind!r} does not name this data config ({kind}); "
                             f"choose the dataset with the group: "
                             f"{' or '.join(f'data={k}' for k in DATA_KINDS)}")
        at_least("data", 1, seq_len=self.seq_len, batch_per_dp_rank=self.batch_per_dp_rank)
        one_of("data.packing", self.packing, PACKINGS)

    @property
    def packed(self) -> bool:
        """Whether the model sees the document boundaries (``packing="documents"``)."""
        return self.packing == "documents"


@dataclass
class RecallData(_Batches):
    """The synthetic long-range recall task (``usp.data.synthetic.RecallTask``)."""

    kind: str = "recall"
    seq_len: int = 512
    batch_per_dp_rank: int = 8
    n_pairs: int = 8  # distinct key->value pairs per sequence
    n_queries: int = 8  # questions at the end of each sequence
    seed: int = 1234
    eval_batches: int = 4  # held-out batches scored at the end of a run
    documents_per_row: int = 1  # > 1: recall documents of random lengths packed in a row
    packing: str = "none"  # none | documents (see the module docstring)

    def __post_init__(self) -> None:
        self._check("recall")
        at_least("data", 0, eval_batches=self.eval_batches)
        at_least("data", 1, n_pairs=self.n_pairs, n_queries=self.n_queries,
                 documents_per_row=self.documents_per_row)
        if self.n_queries > self.n_pairs:
            raise ValueError(f"data.n_queries={self.n_queries} > data.n_pairs={self.n_pairs}: "
                             f"each query asks a distinct pair; set data.n_queries<="
                             f"{self.n_pairs} or raise data.n_pairs")


@dataclass
class MemmapData(_Batches):
    """Token files made by ``python -m usp.data.prepare`` (``usp.data.memmap.MemmapTokens``)."""

    kind: str = "memmap"
    seq_len: int = 1024
    batch_per_dp_rank: int = 4
    path: Optional[str] = None  # prefix of {path}.bin / {path}.json (/ {path}.docs)
    seed: int = 1234
    packing: str = "none"  # documents: needs the {path}.docs boundaries usp.data.prepare writes

    def __post_init__(self) -> None:
        self._check("memmap")
        if not self.path:
            raise ValueError("data.path is not set; set it to the prefix of the .bin/.json "
                             "files that python -m usp.data.prepare writes")


DATA_KINDS: dict[str, type] = {"recall": RecallData, "memmap": MemmapData}
DataConfig = Union[RecallData, MemmapData]
