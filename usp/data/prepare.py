"""``usp-prepare``: a folder of documents -> token files for ``data=memmap``, offline.

::

    usp-prepare --src DIR --glob '**/*.jsonl' --out PREFIX [--tokenizer PATH|bytes]
                [--text-key text] [--messages-key messages] [--chat-template FILE]
                [--val-fraction 0.01] [--workers N] [--no-eos]
                [--eos-token TOKEN] [--strict] [--max-bytes N] [--quiet]

Inputs (``usp.data.sources``): ``.jsonl``/``.jsonl.gz`` (a document per line, the text under
``--text-key``), ``.parquet`` (the column ``--text-key``), anything else one document per
file. Tokenizer (``usp.data.tokenize``): ``bytes`` (the default: ids are the UTF-8 bytes,
EOS 256, vocab 257), a ``tokenizer.json``, or a tokenizer directory; EOS is appended to
every document.

Conversations (``usp.data.chat``): when the corpus's first record holds ``--messages-key``
(a list of ``{role, content}``), every record is a conversation, rendered with the
tokenizer's chat template (``--chat-template FILE`` gives or replaces it) and written as one
document (EOS after it, no loss on it), with ``PREFIX.loss`` (and ``PREFIX.val.loss``): 1 on
each token an assistant turn holds, its end-of-turn token included; the ``.json`` says
``loss_kind: "assistant"``, ``chat: true`` and where the template came from. A corpus mixing
text and conversations is refused; a conversation without an assistant turn, with an unknown
role, not a list of ``{role, content}`` strings or that the template cannot render is a bad
line (skipped and counted, or refused under ``--strict``). The saved tokenizer keeps the
template, so it travels to ``usp-train``'s run and ``usp-export``'s tokenizer.

Outputs, all or nothing: ``PREFIX.{bin,json,docs}`` the training split,
``PREFIX.val.{bin,json,docs}`` the validation split (documents chosen by a hash of their
``path:line``, ``--val-fraction`` of them; none at 0), ``PREFIX.tokenizer/`` the tokenizer's
files (``AutoTokenizer`` loads them; none for bytes). Every file is completed under a
``.tmp`` name and renamed at the end, the training ``.json`` last, so an interrupted run
leaves the previous output as it was. The files are byte-identical for any ``--workers``
and any file-system order: files go in the order of their relative paths and the workers'
results are written in that order.

``--workers N``: N processes tokenize while this one reads and writes (1: all in this
process). Memory is bounded by the tasks in flight (``TASK_BYTES`` of text each, two per
worker), not by the corpus.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from .chat import chat_spec, encoder_for, template_hash
from .files import TokenWriter, data_paths, docs_path, tokenizer_dir
from .sources import Corpus, Piece, Problems, is_chat, list_files
from .tokenize import BYTE_EOS, BYTE_VOCAB, TokenizerSpec, load_tokenizer

__all__ = ["prepare", "main", "list_files", "EOS", "VOCAB_SIZE"]

EOS, VOCAB_SIZE = BYTE_EOS, BYTE_VOCAB  # the byte tokenizer's
TASK_BYTES = 1 << 20  # text handed to a worker at a time
TASK_PIECES = 4096
POOL_BYTES = 8 << 20  # a smaller corpus is tokenized in this process: starting workers costs more
VAL_SUFFIX = ".val"


def prepare(src: str | Path, pattern: str, out: str | Path, max_bytes: int | None = None, *,
            tokenizer: str | Path = "bytes", text_key: str = "text", val_fraction: float = 0.01,
            workers: int | None = 1, no_eos: bool = False, eos_token: str | None = None,
            strict: bool = False, progress: bool = False, messages_key: str = "messages",
            chat_template: str | Path | None = None, log=print) -> dict:
    """Tokenize the documents of ``src`` matching ``pattern`` into ``out``'s files (see the
    module docstring); returns the training split's metadata, with ``val`` (the validation
    split's, or None) and ``problems``.

    Raises ``ValueError`` before writing anything for a bad argument, a missing folder or
    tokenizer, no matching file, conversations without a chat template; and after reading,
    with nothing written, for a corpus without documents, one mixing text and conversations
    or (``strict``) a bad line. ``log`` gets the summary lines."""
    src = Path(src)
    asked, workers = workers is not None, default_workers() if workers is None else workers
    _check_args(src, max_bytes, val_fraction, workers)
    spec = load_tokenizer(tokenizer, eos_token=eos_token, no_eos=no_eos)
    files = list_files(src, pattern)
    if not files:
        raise ValueError(f"no files under {src} match the pattern {pattern!r}; pick a pattern "
                         "relative to src such as '**/*.jsonl' or '**/*.txt' (--glob)")
    chat = is_chat(src, files, text_key, messages_key)
    spec, extra = _template(spec, chat, chat_template)
    problems = Problems(strict=strict)
    corpus = Corpus(src, files, text_key, val_fraction, problems, raw=spec.is_bytes,
                    max_bytes=max_bytes, messages_key=messages_key, chat=chat)
    source = {"src": str(src), "glob": pattern, "text_key": text_key, "max_bytes": max_bytes,
              "val_fraction": val_fraction, **({"messages_key": messages_key} if chat else {})}
    splits = {name: TokenWriter(f"{out}{suffix}", spec.vocab_size, spec.name, source,
                                loss_mask=chat)
              for name, suffix in (("train", ""), ("val", VAL_SUFFIX))
              if name == "train" or val_fraction > 0}
    tok_tmp = tokenizer_dir(out).with_name(tokenizer_dir(out).name + ".tmp")
    t0 = time.perf_counter()
    total = sum(f.stat().st_size for f in files)
    if total < POOL_BYTES:
        if workers > 1 and asked:
            log(f"note: {total / 1e6:.1f} MB of input is tokenized in this process (workers "
                f"start only from {POOL_BYTES / 1e6:.0f} MB, where they pay for their start)")
        workers = 1
    try:
        _write(corpus, spec if chat else spec.state, workers, spec.eos_id, splits, progress,
               total)
        train = splits["train"]
        if not train.num_documents:
            raise ValueError(_no_documents(src, pattern, corpus, problems, splits))
        source.update(num_files=corpus.files_used, num_bytes=corpus.taken,
                      empty_documents=corpus.empty)
        val = splits.get("val")
        if val is not None and not val.num_documents:  # a small corpus, a small fraction
            val.abort()
            del splits["val"]
            log(f"note: no document fell in the validation split ({train.num_documents} "
                f"documents x {val_fraction} = {train.num_documents * val_fraction:.2f}); no "
                f"{out}{VAL_SUFFIX}.* written; raise --val-fraction for one")
        extra.update(eos_id=spec.eos_id, problems=problems.as_dict(),
                     tokenizer_hash=spec.fingerprint)
        if not spec.is_bytes:
            extra["tokenizer_dir"] = tokenizer_dir(out).name
        val_meta = (splits["val"].finish(split="validation", **extra) if "val" in splits
                    else None)
        meta = train.finish(split="train", val=None if val_meta is None else
                            {k: val_meta[k] for k in ("num_tokens", "num_documents")}, **extra)
        shutil.rmtree(tok_tmp, ignore_errors=True)
        spec.save(tok_tmp)
    except BaseException:
        for w in splits.values():
            w.abort()
        shutil.rmtree(tok_tmp, ignore_errors=True)
        raise
    _publish(out, splits, tok_tmp, spec)
    seconds = time.perf_counter() - t0
    meta.update(val=val_meta, seconds=seconds)
    _summary(meta, val_meta, problems, corpus, out, spec, seconds, log)
    return meta


def _template(spec: TokenizerSpec, chat: bool, template: str | Path | None):
    """The tokenizer with the chat template it renders with and saves, and the metadata a
    corpus of conversations adds (``loss_kind``, ``chat``, ``chat_template``: where the
    template came from, and its hash); a given template also travels with a text corpus."""
    if chat:
        spec, where = chat_spec(spec, template)
        return spec, {"loss_kind": "assistant", "chat": True, "chat_template": where,
                      "chat_template_hash": template_hash(spec)}
    if template is not None:
        if spec.is_bytes:
            raise ValueError("--chat-template goes with a Hugging Face tokenizer, which saves "
                             "it; the byte tokenizer saves no files; drop it or pass --tokenizer")
        spec, _ = chat_spec(spec, template)
    return spec, {}


def _write(corpus: Corpus, state, workers: int, eos_id, splits: dict, progress: bool,
           total: int) -> None:
    """Encode the corpus and write each task's blocks to its split, in corpus order."""
    bar = _Bar(total, progress)
    for pieces, ids, lengths, *chat in _encoded(corpus, state, workers):
        loss = None
        if chat:  # conversations: their masks, and the skipped ones recorded
            loss, reasons = chat
            for piece, why in zip(pieces, reasons):
                if why is not None:
                    corpus.problems.add(f"conversation skipped, {why}", piece.where)
            kept = np.asarray([why is None for why in reasons], bool)
            pieces, lengths = [p for p, k in zip(pieces, kept) if k], lengths[kept]
        for name, block in _blocks(pieces, ids, lengths, eos_id, loss).items():
            splits[name].write_documents(*block)
        bar.update(corpus.bytes_read, sum(w.num_documents for w in splits.values()),
                   sum(w.num_tokens for w in splits.values()))
    bar.close()


def default_workers() -> int:
    """``--workers`` when not given: the CPU count, at most 8."""
    return min(8, os.cpu_count() or 1)


def _check_args(src: Path, max_bytes, val_fraction: float, workers: int) -> None:
    if not src.is_dir():
        raise ValueError(f"src {str(src)!r} is not a directory; pass the folder holding the "
                         "documents (--src)")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes} is negative; pass a byte count >= 0 or None "
                         "for no cap (--max-bytes)")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie in [0, 1), e.g. 0.01 for 1% "
                         "of the documents, 0 for no validation split (--val-fraction)")
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (1: tokenize in this process) "
                         "(--workers)")


def _no_documents(src, pattern, corpus: Corpus, problems: Problems, splits) -> str:
    val = splits.get("val")
    if val is not None and val.num_documents:
        return (f"every document of {src} fell in the validation split ({val.num_documents}); "
                "lower --val-fraction")
    why = "; ".join(problems.lines()) or f"{corpus.empty} empty documents"
    return (f"no documents in the {corpus.files_used} files under {src} matching {pattern!r}: "
            f"{why}; check --glob and {'--messages-key' if corpus.chat else '--text-key'}")


def _publish(out, splits: dict, tok_tmp: Path, spec: TokenizerSpec) -> None:
    """Rename everything into place: tokenizer, validation split, training split (its .json
    last); remove what an earlier run left that this one did not write."""
    tok = tokenizer_dir(out)
    shutil.rmtree(tok, ignore_errors=True)
    if not spec.is_bytes:
        os.replace(tok_tmp, tok)
    if "val" in splits:
        splits["val"].publish()
    else:
        for path in (*data_paths(f"{out}{VAL_SUFFIX}"), docs_path(f"{out}{VAL_SUFFIX}")):
            path.unlink(missing_ok=True)
    splits["train"].publish()


def _encoded(corpus: Corpus, state, workers: int):
    """(pieces, ids, lengths[, loss, reasons]) per task, in corpus order (``encoder_for``
    ``state``: a ``TokenizerSpec`` for conversations); ``workers`` processes encode."""
    tasks = _tasks(corpus)
    if workers == 1:
        enc = encoder_for(state)
        for pieces in tasks:
            yield (pieces, *enc.encode([p.text for p in pieces]))
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                             initializer=_init_worker, initargs=(state,)) as pool:
        pending: deque = deque()  # at most 2 per worker in flight: memory stays bounded
        try:
            for pieces in tasks:
                pending.append((pieces, pool.submit(_encode, [p.text for p in pieces])))
                if len(pending) >= 2 * workers:
                    done, fut = pending.popleft()
                    yield (done, *fut.result())
            while pending:
                done, fut = pending.popleft()
                yield (done, *fut.result())
        finally:
            for _, fut in pending:
                fut.cancel()


def _tasks(corpus: Corpus):
    batch, size = [], 0
    for piece in corpus:
        batch.append(piece)
        size += piece.size
        if size >= TASK_BYTES or len(batch) >= TASK_PIECES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


_ENCODER = None


def _init_worker(state) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # this process is one of the workers
    _ENCODER = encoder_for(state)


def _encode(texts: list):
    return _ENCODER.encode(texts)


def _blocks(pieces: list[Piece], ids: np.ndarray, lengths: np.ndarray,
            eos_id: int | None, loss: np.ndarray | None = None) -> dict:
    """One task's tokens per split: {"train"/"val": (tokens, document starts[, loss])}, EOS
    after each document's last piece (no loss on it)."""
    last = np.fromiter((p.last for p in pieces), bool, len(pieces))
    if eos_id is not None and last.any():
        at = np.cumsum(lengths)[last]  # after each finished document
        ids = np.insert(ids, at, eos_id)
        loss = None if loss is None else np.insert(loss, at, 0)
        lengths = lengths + last
    val = np.fromiter((p.val for p in pieces), bool, len(pieces))
    first = np.fromiter((p.first for p in pieces), bool, len(pieces))
    out = {}
    for name, mine in (("train", ~val), ("val", val)):
        if mine.any():
            kept = np.where(mine, lengths, 0)
            starts = (np.cumsum(kept) - kept)[mine & first]  # offsets in this split's block
            take = np.repeat(mine, lengths)
            out[name] = (ids[take], starts) + (() if loss is None else (loss[take],))
    return out


class _Bar:
    """A progress bar on stderr: input MB (and MB/s), documents, tokens."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="usp-prepare",
                            dynamic_ncols=True, mininterval=0.5, file=sys.stderr)

    def update(self, done_bytes: int, documents: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(done_bytes - self.bar.n)
            self.bar.set_postfix(docs=documents, tokens=tokens, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _summary(meta, val_meta, problems: Problems, corpus: Corpus, out, spec, seconds, log):
    docs = meta["num_documents"] + (val_meta["num_documents"] if val_meta else 0)
    tokens = meta["num_tokens"] + (val_meta["num_tokens"] if val_meta else 0)
    log(f"usp-prepare: {docs} documents from {corpus.files_used} files ({corpus.taken / 1e6:.1f} "
        f"MB of text) -> {tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} "
        f"tokens/s), {spec.name}, vocab {spec.vocab_size}, {meta['dtype']}")
    log(f"  train: {out}.bin  {meta['num_tokens']} tokens, {meta['num_documents']} documents")
    if val_meta:
        log(f"  val:   {out}{VAL_SUFFIX}.bin  {val_meta['num_tokens']} tokens, "
            f"{val_meta['num_documents']} documents")
    if not spec.is_bytes:
        log(f"  tokenizer: {tokenizer_dir(out)}/")
    if meta.get("chat"):
        masked = meta["loss_tokens"] + (val_meta["loss_tokens"] if val_meta else 0)
        log(f"  chat: {docs} conversations, template from {meta['chat_template']}; assistant "
            f"tokens (the loss mask, {out}.loss): {masked} of {tokens} "
            f"({masked / max(tokens, 1):.1%})")
    if corpus.empty:
        log(f"  {corpus.empty} empty documents skipped")
    for line in problems.lines():
        log(f"  {line}")
    if problems.total > docs:
        log(f"warning: more lines were skipped ({problems.total}) than documents written "
            f"({docs}); check --text-key and --glob, or pass --strict to stop at the first")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="usp-prepare",
                                 description="Tokenize a folder of documents (or of "
                                             "conversations, with the assistant's loss mask) into "
                                             "token files for data=memmap (training and "
                                             "validation splits).")
    ap.add_argument("--src", required=True, help="folder to read documents from")
    ap.add_argument("--glob", default="**/*.txt",
                    help="pattern relative to --src (default '**/*.txt'); .jsonl(.gz) and "
                         ".parquet files hold a document per line/row, others one per file")
    ap.add_argument("--out", required=True,
                    help="output prefix: OUT.bin/.json/.docs (conversations: .loss), OUT.val.*, "
                         "OUT.tokenizer/")
    ap.add_argument("--tokenizer", default="bytes",
                    help="'bytes' (default), a tokenizer.json file or a tokenizer directory")
    ap.add_argument("--text-key", default="text", help="JSON key / Parquet column of the text")
    ap.add_argument("--messages-key", default="messages",
                    help="JSON key / Parquet column of a conversation (a list of {role, "
                         "content}); a corpus whose first record holds it is chat")
    ap.add_argument("--chat-template", default=None, metavar="FILE",
                    help="a Jinja chat template that gives or replaces the tokenizer's; it "
                         "renders the conversations and is saved with the tokenizer")
    ap.add_argument("--val-fraction", type=float, default=0.01,
                    help="share of documents in the validation split (default 0.01; 0: none)")
    ap.add_argument("--workers", type=int, default=None,
                    help="tokenizing processes (default: min(8, CPUs); 1: this process)")
    ap.add_argument("--no-eos", action="store_true", help="append no EOS after documents")
    ap.add_argument("--eos-token", default=None,
                    help="the EOS token's text, where the tokenizer files do not declare one")
    ap.add_argument("--strict", action="store_true", help="stop at the first bad line")
    ap.add_argument("--max-bytes", type=int, default=None, help="cap on document bytes read")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        prepare(args.src, args.glob, args.out, args.max_bytes, tokenizer=args.tokenizer,
                text_key=args.text_key, val_fraction=args.val_fraction, workers=args.workers,
                no_eos=args.no_eos, eos_token=args.eos_token, strict=args.strict,
                progress=not args.quiet, messages_key=args.messages_key,
                chat_template=args.chat_template)
    except ValueError as e:
        print(f"usp-prepare: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"usp-prepare: interrupted; nothing written at {args.out}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
