"""A dataset as the training loop takes it (``TrainingData``), built from the data config
(``build_dataset``, which also refuses missing or corrupt data before anything starts)."""

from __future__ import annotations

from dataclasses import replace

from ..config import DataConfig, MemmapData, ModelConfig, RecallData
from .files import data_paths, read_meta
from .packing import Batch


class TrainingData:
    """A dataset as the training loop uses it: this rank's batches, the answer accuracy on
    them, and how many held-out batches to score at the end (``eval_batches``).

    ``packed``: batches carry document ids (``data.packing=documents``); ``rope``: the
    model's ``rope``, ``per_document`` adds the positions inside each document."""

    def __init__(self, source, answers_per_sequence: int = 0, eval_batches: int = 0,
                 packed: bool = False, rope: str = "global"):
        self.source = source
        self.answers_per_sequence = answers_per_sequence  # 0: plain text, nothing to score
        self.eval_batches = eval_batches if answers_per_sequence else 0
        self.packed, self.rope = packed, rope

    @property
    def has_answers(self) -> bool:
        return self.answers_per_sequence > 0

    def batch(self, step, batch_per_dp_rank, dp_rank, dp_size, positions):
        """This rank's (tokens, labels), each [B, L/P]; labels shifted on the global sequence."""
        return self.source.batch(step, batch_per_dp_rank, dp_rank, dp_size, positions=positions)

    def model_batch(self, step, batch_per_dp_rank, dp_rank, dp_size, positions) -> Batch:
        """This rank's ``Batch`` [B, L/P] as the model takes it: ``segment_ids`` when packed,
        ``doc_positions`` (the RoPE positions) when ``rope=per_document``, else None."""
        if not self.packed:
            return Batch(*self.batch(step, batch_per_dp_rank, dp_rank, dp_size, positions))
        b = self.source.packed_batch(step, batch_per_dp_rank, dp_rank, dp_size,
                                     positions=positions)
        return b if self.rope == "per_document" else replace(b, doc_positions=None)

    def answer_accuracy(self, predictions, labels) -> tuple[int, int]:
        """(correct answers, answers) on this rank's shard; (0, 0) for plain text.

        ``predictions``: each token's argmax [B, n] long (what the model's loss path
        returns), or logits [B, n, V]."""
        if not self.has_answers:
            return 0, 0
        from .synthetic import answer_accuracy

        correct, answers = answer_accuracy(predictions, labels)
        return int(correct), int(answers)


AUTO = "auto"  # model.vocab_size=auto: the data's vocabulary


def data_vocab(dc: DataConfig) -> int:
    """The vocabulary of ``dc``'s token files (their ``vocab_size``: the tokenizer's every
    id, special tokens included), from the metadata alone; what ``model.vocab_size=auto``
    takes. ValueError for the recall task, which has no vocabulary of its own."""
    if not isinstance(dc, MemmapData):
        raise ValueError(f"model.vocab_size=auto takes the vocabulary of token files, and "
                         f"data={dc.kind} has none; set model.vocab_size to a number (the "
                         f"default is {ModelConfig.vocab_size})")
    bin_path, json_path = data_paths(dc.path)
    return int(read_meta(json_path, bin_path.with_suffix(""))["vocab_size"])


def check_vocab(dc: DataConfig, mc: ModelConfig) -> None:
    """Refuse a model whose vocabulary is smaller than the token files' (ValueError with
    both numbers and the fix); reads only the metadata, so every task of a launch can run
    it before any process group."""
    if isinstance(dc, MemmapData):
        have = data_vocab(dc)
        if have > mc.vocab_size:
            raise ValueError(
                f"dataset {dc.path} has vocab_size {have} > model.vocab_size {mc.vocab_size}: "
                f"its ids would index past the embedding; set model.vocab_size={have} (or "
                f"model.vocab_size=auto)")


def build_dataset(dc: DataConfig, mc: ModelConfig) -> TrainingData:
    """The dataset ``dc`` describes, for a model of ``mc``'s vocabulary and RoPE."""
    if mc.rope == "per_document" and not dc.packed:
        raise ValueError(f"model.rope=per_document restarts positions at each document, but "
                         f"data.packing={dc.packing} gives the model no documents; set "
                         f"data.packing=documents or model.rope=global")
    packing = {"packed": dc.packed, "rope": mc.rope}
    if isinstance(dc, RecallData):
        from .synthetic import RecallTask

        task = RecallTask(vocab_size=mc.vocab_size, seq_len=dc.seq_len, n_pairs=dc.n_pairs,
                          n_queries=dc.n_queries, seed=dc.seed,
                          documents_per_row=dc.documents_per_row)
        return TrainingData(task, answers_per_sequence=dc.n_queries * dc.documents_per_row,
                            eval_batches=dc.eval_batches, **packing)
    if isinstance(dc, MemmapData):
        from .memmap import MemmapTokens

        ds = MemmapTokens(dc.path, dc.seq_len, seed=dc.seed, documents=dc.packed)
        check_vocab(dc, mc)
        return TrainingData(ds, **packing)
    raise ValueError(f"data config {dc!r} is none of RecallData, MemmapData; build it with "
                     f"one of them")
