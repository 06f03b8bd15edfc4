"""A dataset as the training loop takes it (``TrainingData``), built from the data config
(``build_dataset``, which also refuses missing or corrupt data before anything starts)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import DataConfig, MemmapData, ModelConfig, RecallData
from .files import PREPARE_HINT, data_paths, read_meta
from .indexing import step_indices
from .packing import Batch


class TrainingData:
    """A dataset as the training loop uses it: this rank's batches, the answer accuracy on
    them, and how many held-out batches to score at the end (``eval_batches``).

    ``packed``: batches carry document ids (``data.packing=documents``); ``rope``: the
    model's ``rope``, ``per_document`` adds the positions inside each document."""

    def __init__(self, source, answers_per_sequence: int = 0, eval_batches: int = 0,
                 packed: bool = False, rope: str = "global", eval_windows: int = 0):
        self.source = source
        self.eval_windows = eval_windows  # a validation split: its first windows scored
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
        """This rank's ``Batch`` [B, L/P] at ``step`` (``step_indices``); see ``model_rows``."""
        return self.model_rows(step_indices(step, batch_per_dp_rank, dp_rank, dp_size),
                               positions)

    def model_rows(self, samples, positions) -> Batch:
        """The ``Batch`` [B, L/P] of global samples ``samples`` as the model takes it, at the
        columns ``positions`` ([L/P] for every row, or [B, L/P] each row its own):
        ``segment_ids`` when packed, ``doc_positions`` (the RoPE positions) when
        ``rope=per_document``, else None."""
        return self._model(self.source.rows(samples, positions, packed=self.packed))

    def doc_lengths(self, samples) -> list[tuple[int, ...]]:
        """The document lengths of each row of global samples ``samples`` (packed data):
        what a per_document layout of their batch is made of, the same on every rank."""
        return self.source.doc_lengths(samples)

    def window_doc_lengths(self, windows) -> list[tuple[int, ...]]:
        """``doc_lengths`` of the token file's windows ``windows`` (``model_windows``'s)."""
        return self.source.window_doc_lengths(windows)

    def model_windows(self, windows, positions) -> Batch:
        """``model_rows`` for the token file's windows ``windows`` in file order (the
        validation split's first windows)."""
        return self._model(self.source.windows(windows, positions, packed=self.packed))

    def epochs(self, consumed: int) -> dict[str, float]:
        """Epochs completed after ``consumed`` samples, as metrics: ``{"epoch": e}`` for a
        token file, ``{"epoch/<name>": e, ...}`` per source of a blend, ``{}`` for a
        synthetic task (no epochs)."""
        if hasattr(self.source, "names"):  # a blend
            return {f"epoch/{k}": v for k, v in self.source.epochs(consumed).items()}
        order = getattr(self.source, "order", None)
        return {} if order is None else {"epoch": order.epochs(consumed)}

    def _packs(self) -> list:
        """The sources that pack whole documents (``usp.data.whole.WholeRows``)."""
        return [s for s in getattr(self.source, "sources", [self.source]) if hasattr(s, "note")]

    def packing_notes(self) -> list[str]:
        """What a run says at its start of its whole-document packing (padding, dropped)."""
        return [s.note() for s in self._packs()]

    def padding(self, samples) -> dict[str, float]:
        """``{"pad_share": p}``: the padding share of the rows of global samples
        ``samples`` (``data.packing=whole``, one token file); ``{}`` otherwise."""
        if self.source is not None and hasattr(self.source, "row_padding"):
            return {"pad_share": self.source.row_padding(samples)}
        return {}

    def _model(self, b: Batch) -> Batch:
        if not self.packed:
            return Batch(b.tokens, b.labels)
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


def _meta(prefix: str) -> dict:
    """The metadata of ``prefix``'s token files; FileNotFoundError names the missing one."""
    bin_path, json_path = data_paths(prefix)
    if not bin_path.is_file():
        raise FileNotFoundError(f"token file {bin_path} not found; create it with: "
                                f"{PREPARE_HINT.format(prefix=bin_path.with_suffix(''))}")
    return read_meta(json_path, bin_path.with_suffix(""))


def data_vocab(dc: DataConfig) -> int:
    """The vocabulary of ``dc``'s token files (their ``vocab_size``: the tokenizer's every
    id, special tokens included), from the metadata alone; what ``model.vocab_size=auto``
    takes. ValueError for the recall task, which has no vocabulary of its own, and for a
    blend of files made with different tokenizers."""
    if not isinstance(dc, MemmapData):
        raise ValueError(f"model.vocab_size=auto takes the vocabulary of token files, and "
                         f"data={dc.kind} has none; set model.vocab_size to a number (the "
                         f"default is {ModelConfig.vocab_size})")
    metas = [(path, _meta(path)) for path, _ in dc.sources()]
    # the tokenizer's content where usp-prepare recorded it, else its name
    kinds = {(m.get("tokenizer_hash", m["tokenizer"]), int(m["vocab_size"])) for _, m in metas}
    if len(kinds) > 1:
        seen = "; ".join(f"{p}: {m['tokenizer']}, vocab {m['vocab_size']}" for p, m in metas)
        raise ValueError(f"data.blend mixes token files of different tokenizers ({seen}); "
                         "prepare every source with the same --tokenizer")
    return int(metas[0][1]["vocab_size"])


def data_eos_id(dc: DataConfig) -> int | None:
    """The id usp-prepare ended each document with (the token files' ``eos_id``; a blend's
    first source), None for the recall task and files prepared with ``--no-eos``."""
    if not isinstance(dc, MemmapData):
        return None
    eos = _meta(dc.sources()[0][0]).get("eos_id")
    return None if eos is None else int(eos)


def check_vocab(dc: DataConfig, mc: ModelConfig) -> None:
    """Refuse a model whose vocabulary is smaller than the token files' (ValueError with
    both numbers and the fix); reads only the metadata, so every task of a launch can run
    it before any process group."""
    if isinstance(dc, MemmapData):
        have = data_vocab(dc)
        if have > mc.vocab_size:
            where = dc.path or ", ".join(p for p, _ in dc.sources())
            if mc.pretrained is not None:  # the checkpoint's embedding is fixed
                raise ValueError(
                    f"dataset {where} has vocab_size {have} > the embedding of model.pretrained"
                    f"={mc.pretrained} ({mc.vocab_size} rows): its ids would index past it; "
                    "prepare the data with the checkpoint's tokenizer (usp-prepare "
                    "--tokenizer DIR)")
            raise ValueError(
                f"dataset {where} has vocab_size {have} > model.vocab_size {mc.vocab_size}: "
                f"its ids would index past the embedding; set model.vocab_size={have} (or "
                f"model.vocab_size=auto)")


EVAL_WINDOWS = 16  # validation windows scored when trainer.eval_windows is not set


def validation_prefix(prefix: str) -> str:
    """Where ``usp-prepare`` writes the validation split of ``prefix``: ``PREFIX.val``."""
    return f"{data_paths(prefix)[0].with_suffix('')}.val"


def source_names(dc: MemmapData) -> list[str]:
    """What the metrics call each source: its file name (``epoch/<name>``), the index
    added where two share one."""
    names = [Path(p).name for p, _ in dc.sources()]
    return [n if names.count(n) == 1 else f"{n}.{i}" for i, n in enumerate(names)]


def loss_notes(dc: DataConfig) -> list[str]:
    """What a run says once at its start of the loss masks it reads: for each source whose
    token files carry one (``{path}.loss``) under ``data.loss_on=auto``, the share of tokens
    its loss counts (from the metadata alone)."""
    if not isinstance(dc, MemmapData) or dc.loss_on == "all":
        return []
    from .files import data_paths, loss_path, read_meta

    out = []
    for path, _ in dc.sources():
        bin_path, json_path = data_paths(path)
        meta = read_meta(json_path, bin_path.with_suffix("")) if json_path.is_file() else {}
        if meta.get("loss_mask"):
            share = int(meta.get("loss_tokens", 0)) / max(1, int(meta["num_tokens"]))
            out.append(f"{path}: loss on {share:.1%} of the tokens, as its loss mask says "
                       f"({loss_path(path).name}; data.loss_on=all counts every token)")
    return out


def build_validation(dc: DataConfig, mc: ModelConfig,
                     eval_windows: int | None) -> list[tuple[str, float, TrainingData]]:
    """(name, weight, split) of each source's validation split (``PREFIX.val.*``) with
    ``eval_windows`` (its first windows; None: up to ``EVAL_WINDOWS``); empty when there is
    nothing to score: the recall task (it has ``eval_batches``), or no usable split and no
    ``eval_windows`` asked for (a source of a blend without one is left out). Asked for
    without a split, or more windows than a split holds: ValueError with the numbers and
    the fix."""
    if not isinstance(dc, MemmapData):
        if eval_windows is not None:
            raise ValueError(f"trainer.eval_windows={eval_windows} scores the validation split "
                             f"of token files, and data={dc.kind} has none (it scores "
                             f"data.eval_batches); set trainer.eval_windows=null")
        return []
    out = []
    for name, (path, weight) in zip(source_names(dc), dc.sources()):
        prefix = validation_prefix(path)
        try:
            ds = open_tokens(prefix, dc, dc.seed)
        except (FileNotFoundError, ValueError) as e:
            if eval_windows is None:
                continue
            why = str(e).split("; ")[0]  # without the reader's own fix: it names this prefix
            raise ValueError(f"trainer.eval_windows={eval_windows} asks for validation, but "
                             f"the split {prefix}.bin cannot be read ({why}); usp-prepare "
                             f"--out {path} writes it beside the training split "
                             "(--val-fraction, default 0.01), or set trainer.eval_windows=null"
                             ) from None
        check_vocab(replace(dc, path=prefix, blend=None), mc)
        windows = min(EVAL_WINDOWS, ds.num_windows) if eval_windows is None else eval_windows
        if windows > ds.num_windows:
            raise ValueError(f"trainer.eval_windows={eval_windows} but {prefix}.bin holds "
                             f"{ds.num_windows} windows of data.seq_len {dc.seq_len} tokens; "
                             f"set trainer.eval_windows<={ds.num_windows}")
        out.append((name, weight, TrainingData(ds, packed=dc.packed, rope=mc.rope,
                                               eval_windows=windows)))
    return out


def open_tokens(path: str, dc: MemmapData, seed: int, phase: int = 0,
                weights: bool = False):
    """The token files at ``path`` as ``dc`` reads them: ``MemmapTokens`` windows, or under
    ``data.packing=whole`` its ``usp.data.whole.WholeRows`` (``weights``: with each
    labelled token's loss weight, ``trainer.loss_norm=document``). ``data.loss_on=assistant``
    refuses files whose loss mask is not the assistant's (metadata ``loss_kind``)."""
    from .memmap import MemmapTokens

    ds = MemmapTokens(path, dc.seq_len, seed=seed, documents=dc.packed, phase=phase,
                      loss=dc.loss_on != "all", windows=dc.packing != "whole")
    if dc.loss_on == "assistant" and not (ds.loss is not None
                                          and ds.meta.get("loss_kind") == "assistant"):
        has = (f"a loss mask of kind {ds.meta.get('loss_kind')!r}" if ds.loss is not None
               else "no loss mask")
        raise ValueError(f"data.loss_on=assistant but {ds.json_path} has {has} (no "
                         "loss_kind: assistant): the files carry no assistant spans; prepare "
                         "conversations (usp-prepare on records with messages) or set "
                         "data.loss_on=auto")
    if dc.packing != "whole":
        return ds
    from .whole import WholeRows

    return WholeRows(ds, dc.seq_len, seed, phase, on_long=dc.on_long, weights=weights)


def check_loss_norm(dc: DataConfig, loss_norm: str) -> None:
    """Refuse ``trainer.loss_norm=document`` where a document can be cut across rows: it
    needs token files under ``data.packing=whole``."""
    if loss_norm == "document" and not (isinstance(dc, MemmapData) and dc.packing == "whole"):
        raise ValueError(f"trainer.loss_norm=document weighs every document the same, which "
                         f"needs each one whole in one row, but data.kind={dc.kind} "
                         f"data.packing={dc.packing}; set data.packing=whole (token files) or "
                         "trainer.loss_norm=token")


def build_dataset(dc: DataConfig, mc: ModelConfig, phase: int = 0,
                  loss_norm: str = "token") -> TrainingData:
    """The dataset ``dc`` describes, for a model of ``mc``'s vocabulary and RoPE, as length
    phase ``phase`` reads it: its own passes, in the order ``(seed, phase, epoch)`` fixes
    (``usp.data.order``; phase 0 is a run without phases). ``loss_norm=document``: its
    batches carry loss weights (``check_loss_norm``)."""
    check_loss_norm(dc, loss_norm)
    if mc.rope == "per_document" and not dc.packed:
        raise ValueError(f"model.rope=per_document restarts positions at each document, but "
                         f"data.packing={dc.packing} gives the model no documents; set "
                         f"data.packing=documents or model.rope=global")
    packing = {"packed": dc.packed, "rope": mc.rope}
    if isinstance(dc, RecallData):
        from .synthetic import RecallTask

        task = RecallTask(vocab_size=mc.vocab_size, seq_len=dc.seq_len, n_pairs=dc.n_pairs,
                          n_queries=dc.n_queries, seed=dc.seed,
                          documents_per_row=dc.documents_per_row, phase=phase)
        return TrainingData(task, answers_per_sequence=dc.n_queries * dc.documents_per_row,
                            eval_batches=dc.eval_batches, **packing)
    if isinstance(dc, MemmapData):
        sources = [open_tokens(path, dc, dc.seed + i, phase, loss_norm == "document")
                   for i, (path, _) in enumerate(dc.sources())]
        check_vocab(dc, mc)
        if dc.blend:
            from .blend import Blend

            return TrainingData(Blend(sources, [w for _, w in dc.sources()], source_names(dc)),
                                **packing)
        return TrainingData(sources[0], **packing)
    raise ValueError(f"data config {dc!r} is none of RecallData, MemmapData; build it with "
                     f"one of them")
