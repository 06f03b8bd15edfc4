"""The peer of ``usp-prepare`` in ``tools.bench_prepare``: Hugging Face ``datasets`` tokenizing
the same JSONL files with the same tokenizer, run as its own process (by path)::

    python tools/lab/prepare_datasets.py --tokenizer DIR --workers N --cache-dir DIR \\
        --out TOKENS.bin --mark MAPPED.json --result RESULT.json FILE.jsonl ...

``load_dataset("json", data_files=FILES, split="train", cache_dir=...)``, then
``Dataset.map(batched=True, num_proc=N)`` (None for 1) encoding each batch with the
tokenizer directory loaded by ``AutoTokenizer`` (``add_special_tokens=False``) and EOS
appended to every document, as usp-prepare does. When the mapped dataset (its arrow cache)
is complete, ``--mark`` gets the wall-clock time (``time.time()``); then the mapped
dataset is read in batches and every ``input_ids`` written to one flat ``--out`` file
(uint16 for a vocabulary of at most 65536 ids, else uint32, like usp's ``.bin``), and
``--result`` gets the counts. Imports nothing from usp.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pyarrow.compute as pc
from datasets import disable_progress_bars, load_dataset
from transformers import AutoTokenizer

READ_BATCH = 8192  # documents per batch when writing the flat file


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="JSONL files, in document order")
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory")
    p.add_argument("--workers", type=int, default=1, help="num_proc of Dataset.map")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--out", required=True, help="the flat token file")
    p.add_argument("--mark", required=True, help="gets the time the mapped dataset was done")
    p.add_argument("--result", required=True, help="gets the counts (JSON)")
    args = p.parse_args(argv)
    disable_progress_bars()

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    eos = tok.eos_token_id

    def encode(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [doc + [eos] for doc in ids]}

    raw = load_dataset("json", data_files=args.files, split="train", cache_dir=args.cache_dir)
    mapped = raw.map(encode, batched=True, remove_columns=raw.column_names,
                     num_proc=args.workers if args.workers > 1 else None)
    with open(args.mark, "w") as f:
        json.dump({"time": time.time()}, f)

    dtype = np.uint16 if len(tok) <= 1 << 16 else np.uint32
    tokens = 0
    with open(args.out, "wb") as f:
        for batch in mapped.with_format("arrow").iter(batch_size=READ_BATCH):
            flat = pc.list_flatten(batch["input_ids"])  # [docs] lists -> [tokens]
            ids = flat.to_numpy().astype(dtype)
            ids.tofile(f)
            tokens += len(ids)
    with open(args.result, "w") as f:
        json.dump({"num_tokens": tokens, "num_documents": mapped.num_rows,
                   "dtype": np.dtype(dtype).name, "vocab_size": len(tok)}, f)


if __name__ == "__main__":
    main()
