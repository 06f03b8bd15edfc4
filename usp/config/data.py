"""``configs/data``: one dataclass per dataset, the option ``configs/data/<kind>.yaml`` of the
same name; ``DATA_KINDS`` maps ``data.kind`` to it. Each dataclass's defaults are that
option's values, except what the option file sets.

``batch_per_dp_rank`` is sequences per data-parallel rank per step; a step's global batch is
``global_batch(dp)`` = ``batch_per_dp_rank * dp``.

``packing`` says what the model sees of the documents in a row: ``none``, the row is one
sequence (attention and RoPE span it whole); ``documents``, each token attends only within
its document, labels crossing a boundary are ignored, and ``model.rope=per_document``
restarts RoPE positions at each document; ``whole`` (token files only), as ``documents``
but each row holds whole documents only, never one cut across rows, the rest of the row
padding (``usp.data.whole``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

from .checks import at_least, one_of

PACKINGS = ("none", "documents", "whole")
LOSS_ON = ("auto", "assistant", "all")
ON_LONG = ("drop", "error")
MISSING_PATH = ""


class _Batches:
    """What every dataset config shares: its kind, sequence length, batch per dp rank and
    packing."""

    kind: str
    seq_len: int
    batch_per_dp_rank: int
    packing: str
    seed: int

    def global_batch(self, dp: int) -> int:
        """Sequences per step over all ``dp`` data-parallel ranks."""
        return self.batch_per_dp_rank * dp

    def _check(self, kind: str) -> None:
        if self.kind != kind:
            raise ValueError(f"data.kind={self.kind!r} does not name this data config ({kind}); "
                             f"choose the dataset with the group: "
                             f"{' or '.join(f'data={k}' for k in DATA_KINDS)}")
        at_least("data", 1, seq_len=self.seq_len, batch_per_dp_rank=self.batch_per_dp_rank)
        at_least("data", 0, seed=self.seed)
        one_of("data.packing", self.packing, PACKINGS)

    @property
    def packed(self) -> bool:
        """Whether the model sees the document boundaries (``packing`` documents or
        whole)."""
        return self.packing in ("documents", "whole")


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
        if self.packing == "whole":
            raise ValueError("data.packing=whole packs the documents of token files; the "
                             "recall task makes its own rows: use data.packing=documents "
                             "with data.documents_per_row > 1, or data=memmap")
        at_least("data", 0, eval_batches=self.eval_batches)
        at_least("data", 1, n_pairs=self.n_pairs, n_queries=self.n_queries,
                 documents_per_row=self.documents_per_row)
        if self.n_queries > self.n_pairs:
            raise ValueError(f"data.n_queries={self.n_queries} > data.n_pairs={self.n_pairs}: "
                             f"each query asks a distinct pair; set data.n_queries<="
                             f"{self.n_pairs} or raise data.n_pairs")


@dataclass
class BlendSource:
    """One corpus of ``data.blend``: the prefix of its token files and its weight."""

    path: str = MISSING_PATH
    weight: float = 1.0


@dataclass
class MemmapData(_Batches):
    """Token files made by ``usp-prepare`` (``usp.data.memmap.MemmapTokens``): one corpus
    (``path``) or a weighted blend of several (``blend``), one of the two."""

    kind: str = "memmap"
    seq_len: int = 1024
    batch_per_dp_rank: int = 4
    path: Optional[str] = None  # prefix of {path}.bin / {path}.json (/ {path}.docs)
    blend: Optional[List[BlendSource]] = None  # [{path, weight}, ...] instead of path
    seed: int = 1234
    packing: str = "none"  # documents: needs the {path}.docs boundaries usp-prepare writes
    # auto: no loss on the tokens a file's loss mask ({path}.loss) leaves out; assistant: the
    # same, refused unless every file's mask is the assistant's (chat data); all: every token
    loss_on: str = "auto"
    on_long: str = "drop"  # packing=whole: a document longer than seq_len is dropped | error

    def __post_init__(self) -> None:
        self._check("memmap")
        one_of("data.loss_on", self.loss_on, LOSS_ON)
        one_of("data.on_long", self.on_long, ON_LONG)
        if self.path and self.blend:
            raise ValueError(f"data.path={self.path} and data.blend ({len(self.blend)} sources) "
                             "are exclusive: a run reads one corpus or a blend; set "
                             "data.path=null to blend")
        for i, src in enumerate(self.blend or []):
            if not src.path or src.path == MISSING_PATH:
                raise ValueError(f"data.blend[{i}] has no path; give each source "
                                 "{path: PREFIX, weight: W}")
            if not src.weight > 0:
                raise ValueError(f"data.blend[{i}].weight={src.weight} must be > 0")

    def sources(self) -> list[tuple[str, float]]:
        """(prefix, weight) of each corpus: ``[(path, 1.0)]`` or the blend's; ValueError
        when neither is set."""
        if self.blend:
            return [(src.path, float(src.weight)) for src in self.blend]
        if not self.path:
            raise ValueError("data.path is not set; set it to the prefix of the .bin/.json "
                             "files that usp-prepare writes (or give data.blend)")
        return [(self.path, 1.0)]


DATA_KINDS: dict[str, type] = {"recall": RecallData, "memmap": MemmapData}
DataConfig = Union[RecallData, MemmapData]
