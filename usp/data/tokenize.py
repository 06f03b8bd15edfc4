"""The tokenizers ``usp-prepare`` runs: the byte tokenizer (no files, no dependencies) and a
Hugging Face tokenizer (a ``tokenizer.json`` file or a local tokenizer directory), offline.

``load_tokenizer`` returns a ``TokenizerSpec``: what the token files record (name, full
vocabulary, EOS id) and a picklable ``state`` from which ``Encoder`` rebuilds the tokenizer
in a worker process. Documents are encoded without the tokenizer's own special tokens (no
BOS or template); ``usp-prepare`` appends the EOS id after each document.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

BYTES = "bytes"
BYTE_EOS = 256  # the byte tokenizer: ids 0..255 are the bytes, 256 ends a document
BYTE_VOCAB = 257
# names a bare tokenizer.json may give its end-of-document token (checked in this order)
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
_EXTRA = "pip install 'usp[data]'"


@dataclass(frozen=True)
class TokenizerSpec:
    """A loaded tokenizer as the token files record it.

    ``name``: ``"bytes+eos"`` or ``"hf:<path>"``; ``vocab_size``: every id it can produce,
    special tokens included; ``eos_id``: appended after each document (None: ``--no-eos``);
    ``state``: ``None`` for bytes, else the tokenizer's JSON (``tokenizers``' ``to_str``);
    ``source``: the path given (None for bytes); ``eos_token``: the EOS token's text;
    ``chat_template``: a template that replaces the tokenizer's own (``--chat-template``)."""

    name: str
    vocab_size: int
    eos_id: int | None
    state: str | None
    source: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    @property
    def is_bytes(self) -> bool:
        return self.state is None

    @property
    def fingerprint(self) -> str:
        """What makes two token files comparable: the tokenizer's content and EOS, not the
        path it was loaded from (``"bytes+eos"`` for the byte tokenizer)."""
        if self.is_bytes:
            return self.name
        return hashlib.sha256(f"{self.state}\0{self.eos_id}".encode()).hexdigest()[:16]

    def with_template(self, template: str) -> TokenizerSpec:
        """This tokenizer with ``template`` as its chat template."""
        return dataclasses.replace(self, chat_template=template)

    def hf_tokenizer(self):
        """The transformers tokenizer (with its chat template: ``chat_template`` when set)."""
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        src = Path(self.source)
        if src.is_dir():  # the user's own files: config, special tokens, chat template
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        else:
            tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self.state),
                                          eos_token=self.eos_token)
        if self.chat_template is not None:
            tok.chat_template = self.chat_template
        return tok

    def save(self, out_dir: Path) -> None:
        """Write files ``AutoTokenizer.from_pretrained(out_dir)`` loads, chat template
        included (nothing for bytes)."""
        if not self.is_bytes:
            self.hf_tokenizer().save_pretrained(str(out_dir))


def _need(module: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise ValueError(f"a Hugging Face tokenizer needs the {module} package, which is not "
                         f"installed; install it with: {_EXTRA} (or use --tokenizer bytes)") from e


def load_tokenizer(spec: str | Path = BYTES, eos_token: str | None = None,
                   no_eos: bool = False) -> TokenizerSpec:
    """``spec``: ``"bytes"``, a ``tokenizer.json`` file, or a directory with tokenizer files
    (``AutoTokenizer``, local files only). ``eos_token`` names the EOS token where the files
    do not; ``no_eos`` appends none. Raises ValueError (missing path, no EOS, a slow-only
    tokenizer, missing packages) with the fix."""
    if str(spec) == BYTES:
        if eos_token is not None:
            raise ValueError("--eos-token names a token of a Hugging Face tokenizer; the byte "
                             f"tokenizer's EOS is id {BYTE_EOS}; drop --eos-token")
        return TokenizerSpec("bytes+eos", BYTE_VOCAB, None if no_eos else BYTE_EOS, None)
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"tokenizer {str(path)!r} not found; pass a tokenizer.json file, a "
                         "local directory with tokenizer files (save_pretrained), or 'bytes'")
    _need("tokenizers")
    if path.is_dir():
        backend, vocab, eos_text, eos_id = _from_directory(path)
    else:
        backend, vocab, eos_text, eos_id = _from_file(path)
    if eos_token is not None:
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"--eos-token {eos_token!r} is not a token of {path}; name one "
                             "of its tokens, or pass --no-eos")
        eos_text = eos_token
    if no_eos:
        eos_id = None
    elif eos_id is None:
        raise ValueError(f"tokenizer {path} declares no EOS token, and usp-prepare ends each "
                         "document with one; name it with --eos-token TOKEN, or pass --no-eos "
                         "to write documents without a separator")
    return TokenizerSpec(f"hf:{path}", vocab, eos_id, backend.to_str(), str(path), eos_text)


def _full_vocab(backend) -> int:
    ids = backend.get_vocab(with_added_tokens=True).values()
    return max(backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def _from_directory(path: Path):
    _need("transformers")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer directory {path} cannot be loaded by AutoTokenizer "
                         f"({str(e).splitlines()[0]}); give a directory written by "
                         "save_pretrained, or its tokenizer.json file") from e
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer {path} has no fast (Rust) implementation, which "
                         "usp-prepare's workers run; convert it once with "
                         "AutoTokenizer.from_pretrained(path, use_fast=True).save_pretrained(...)")
    backend = tok.backend_tokenizer
    vocab = max(len(tok), _full_vocab(backend))
    return backend, vocab, tok.eos_token, tok.eos_token_id


def _from_file(path: Path):
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for a bad file
        raise ValueError(f"{path} is not a tokenizers JSON file ({e}); pass a tokenizer.json, "
                         "a tokenizer directory, or 'bytes'") from e
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    names = [n for n in EOS_NAMES if n in special]
    eos = names[0] if names else None
    return backend, _full_vocab(backend), eos, None if eos is None else backend.token_to_id(eos)


class Encoder:
    """Encodes texts with the tokenizer a ``TokenizerSpec.state`` describes (in any process).

    ``encode(texts)`` -> (ids uint32 [sum of lengths], lengths int64 [len(texts)]): the
    documents' ids one after another, without special tokens. Texts are ``str``, or
    ``bytes`` for the byte tokenizer (its ids are the UTF-8 bytes)."""

    def __init__(self, state: str | None):
        self._tok = None
        if state is not None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(state)

    def encode(self, texts: list) -> tuple[np.ndarray, np.ndarray]:
        if self._tok is None:
            parts = [t if isinstance(t, bytes) else t.encode("utf-8") for t in texts]
            lengths = np.fromiter((len(p) for p in parts), np.int64, len(parts))
            ids = np.frombuffer(b"".join(parts), dtype=np.uint8).astype(np.uint32)
            return ids, lengths
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encs = fast(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encs), np.int64, len(encs))
        ids = np.fromiter(chain.from_iterable(e.ids for e in encs), np.uint32, int(lengths.sum()))
        return ids, lengths
