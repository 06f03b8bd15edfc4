"""What the export tests train and export (``unit/test_export.py``,
``distributed/test_export_ranks.py``): a tiny Hugging Face tokenizer, token files made with
it, and small runs of the built-in model and of a transformers model."""

from dataclasses import replace
from pathlib import Path

import numpy as np

from usp.config import MemmapData, ModelConfig, OptimConfig, ParallelConfig, RecallData, RunConfig, TrainerConfig

from _hf_runs import QUIET

TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello usp",
        "sequence parallel training of long contexts", "a ring and an all-to-all"]
MODEL = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                    rope_theta=500.0, norm_eps=1e-6)


def tiny_tokenizer(path: Path):
    """A byte-level BPE of < 96 tokens trained on ``TEXT``, saved at ``path`` the way
    ``AutoTokenizer.from_pretrained`` loads it; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(TEXT * 4, trainers.BpeTrainer(
        vocab_size=90, special_tokens=["<unk>", "<s>", "</s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.save_pretrained(path)
    return tok


def corpus(prefix: Path, n_tokens: int = 4096):
    """Token files ``prefix.bin/.json`` of random ids of a tiny tokenizer, whose files are at
    ``prefix.tokenizer/`` (as usp-prepare leaves them); returns the tokenizer."""
    from usp.data.files import TokenWriter, tokenizer_dir

    tok = tiny_tokenizer(tokenizer_dir(prefix))
    ids = np.random.default_rng(0).integers(0, len(tok), n_tokens)
    with TokenWriter(prefix, vocab_size=len(tok), tokenizer="hf:tiny", source="test") as w:
        w.write(ids)
    return tok


def run_cfg(run_dir: Path, model: ModelConfig = MODEL, data=None, u: int = 1, r: int = 2,
            steps: int = 3) -> RunConfig:
    """A few steps at world u x r on seq_len 64 (the recall task unless ``data``)."""
    data = data or RecallData(seq_len=64, batch_per_dp_rank=2, n_pairs=4, n_queries=4,
                               eval_batches=0)
    return RunConfig(model=model, parallel=ParallelConfig(ulysses_degree=u, ring_degree=r),
                     data=data, optim=OptimConfig(lr=1e-2, warmup_steps=1),
                     trainer=TrainerConfig(steps=steps, run_dir=str(run_dir), nprocs=u * r),
                     logging=QUIET)


def memmap(prefix: Path) -> MemmapData:
    return MemmapData(path=str(prefix), seq_len=64, batch_per_dp_rank=2)


# name -> (model, data is the tokenized corpus, u, r); export architecture in the test
RUNS = {
    "llama": (replace(MODEL, tie_embeddings=False), True, 2, 1),
    "qwen2": (replace(MODEL, sliding_window=12, full_attention_every=2), False, 1, 2),
    "mistral": (replace(MODEL, sliding_window=12, tie_embeddings=False), False, 1, 2),
    "hf_qwen2": (replace(MODEL, hf="qwen2", sliding_window=12, full_attention_every=2), True, 2, 1),
}
