"""A small local checkpoint to try the pretrained journey on (docs/extend.md): a transformers
decoder of the family ``--arch`` (``usp.models.families``: llama, qwen2, mistral, qwen3)
written by its own class's ``save_pretrained``, with a byte-level BPE tokenizer beside it,
trained on the text files under ``--src``.

    python -m tools.tiny_checkpoint --arch qwen2 --out ckpt/tiny_qwen2
    usp-prepare --src SRC --glob '*.py' --out data/tiny --tokenizer ckpt/tiny_qwen2 ...
    usp-train model=pretrained model.pretrained=ckpt/tiny_qwen2 data=memmap data.path=data/tiny ...

The weights are a fresh initialisation (seeded): the checkpoint exercises loading, RoPE
changes, training and export, not a pretrained model's quality. Default text: the top-level
``.py`` files of Python's standard library, the first ``--max-bytes`` of them.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from usp.models.families import BUILTIN

# head_dim stated: Qwen3Config's default (128) is not hidden_size / num_attention_heads
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def texts(src: Path, glob: str, max_bytes: int) -> list[str]:
    """The files under ``src`` matching ``glob``, in name order, up to ``max_bytes``."""
    out, total = [], 0
    for path in sorted(src.glob(glob)):
        if total >= max_bytes:
            break
        text = path.read_text(errors="replace")[:max_bytes - total]
        out.append(text)
        total += len(text)
    if not out:
        raise SystemExit(f"tiny_checkpoint: no file matches {glob!r} under {src}")
    return out


def write_checkpoint(out: Path, arch: str, docs: list[str], vocab: int, seed: int) -> int:
    """Train the tokenizer on ``docs``, write it and a fresh ``arch`` model of its vocabulary
    to ``out``; returns the vocabulary size."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    config_class = getattr(transformers, BUILTIN[arch].config_class)
    config = config_class(**SHAPE, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                          bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return len(tok)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(BUILTIN), default="llama")
    ap.add_argument("--out", type=Path, required=True, help="directory to write (new)")
    ap.add_argument("--src", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                    help="folder of text for the tokenizer (default: Python's stdlib)")
    ap.add_argument("--glob", default="*.py")
    ap.add_argument("--max-bytes", type=int, default=2_000_000)
    ap.add_argument("--vocab", type=int, default=1024, help="tokenizer vocabulary (at most)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"tiny_checkpoint: {args.out} is not empty; give a new directory")
    n = write_checkpoint(args.out, args.arch, texts(args.src, args.glob, args.max_bytes),
                         args.vocab, args.seed)
    print(f"wrote a {args.arch} checkpoint ({SHAPE['num_hidden_layers']} layers x "
          f"{SHAPE['hidden_size']}, vocabulary {n}) and its tokenizer to {args.out}")


if __name__ == "__main__":
    main()
