"""Host memory each rank adds while loading a ``model.pretrained`` checkpoint, at P ranks.

    python -m tools.bench_load                      # ~400 MB fp32 Llama, P = 1, 2, 4
    python -m tools.bench_load --layers 2 --ranks 1,2 --json /tmp/bench_load.json

Makes (once, under ``--work-dir``) a Llama checkpoint with transformers' ``save_pretrained``
(fp32 safetensors), then for each P spawns P gloo ranks that do what ``usp-train`` does: the
built-in model on the meta device, FSDP2-sharded over the P ranks, each rank reading its rows
(``usp.models.shard_load.load_shards``); and, for comparison, the whole state dict read by
every rank (``usp.models.pretrained.load_state``: what a rank holds when it loads everything
before sharding). A sampler thread reads ``/proc/self/status`` every millisecond: the figure
is the peak anonymous memory (RssAnon: the rank's own bytes) above what it held just before
loading. The file's pages that ``safetensors`` maps are the page cache, shared by the ranks
and reclaimable (RssFile), reported beside it. The goal per rank: size / P + the largest
tensor + 10%.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def _anon_file_mb() -> tuple[float, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024  # kB -> MB
    return fields["RssAnon"], fields["RssFile"]


class _Peak:
    """The peak (RssAnon, RssFile) in MB while it runs, sampled every millisecond."""

    def __init__(self):
        self.peak = _anon_file_mb()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            a, f = _anon_file_mb()
            self.peak = (max(self.peak[0], a), max(self.peak[1], f))
            time.sleep(0.001)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def make_checkpoint(path: Path, layers: int, dim: int, vocab: int) -> Path:
    """A Llama of ``layers`` x ``dim`` (16 heads, 4 KV heads, untied, fp32) saved at ``path``."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hc = LlamaConfig(hidden_size=dim, intermediate_size=int(2.75 * dim), num_hidden_layers=layers,
                     num_attention_heads=16, num_key_value_heads=4, vocab_size=vocab,
                     tie_word_embeddings=False)
    LlamaForCausalLM(hc).save_pretrained(path)
    return path


def _rank(ckpt: str, mode: str, out: str) -> None:
    """One rank: build, shard and load as ``mode`` (``shards`` or ``whole``); rank results
    to ``out``.<rank>.json."""
    import gc
    from functools import partial

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from usp.attention import local_attention
    from usp.models.decoder import Transformer
    from usp.models.pretrained import load_state, pretrained_config
    from usp.models.shard_load import load_shards
    from usp.train.build import shard_model

    mc = pretrained_config(ckpt)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    attn = partial(local_attention, causal=True)
    gc.collect()
    dist.barrier()
    before = _anon_file_mb()
    with _Peak() as peak:
        if mode == "shards":
            with torch.device("meta"):
                model = Transformer(mc, attn)
            shard_model(model, mesh, "fp32")
            load_shards(model, mc, "cpu")
        else:
            model = Transformer(mc, attn)
            model.load_state_dict(load_state(mc))
            shard_model(model, mesh, "fp32")
        gc.collect()
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    Path(f"{out}.{dist.get_rank()}.json").write_text(json.dumps({
        "added_mb": peak.peak[0] - before[0], "file_mb": peak.peak[1] - before[1],
        "shard_mb": held}))
    dist.barrier()


def measure(ckpt: Path, ranks: int, mode: str, work: Path) -> dict:
    from usp.launch.local import spawn_local

    out = work / f"result_{mode}_{ranks}"
    spawn_local(_rank, ranks, str(ckpt), mode, str(out), threads=1)
    results = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(ranks)]
    return {k: max(r[k] for r in results) for k in results[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--ranks", default="1,2,4", help="P values, comma separated")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/usp_bench_load"))
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    ckpt = make_checkpoint(args.work_dir / f"llama_{args.layers}x{args.dim}", args.layers,
                           args.dim, args.vocab)
    from safetensors import safe_open

    size = largest = 0
    for f in ckpt.glob("*.safetensors"):
        size += f.stat().st_size
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                n = 4
                for d in shape:
                    n *= d
                largest = max(largest, n)
    size_mb, largest_mb = size / 2**20, largest / 2**20
    print(f"checkpoint {ckpt}: {size_mb:.0f} MB, largest tensor {largest_mb:.0f} MB")
    print(f"{'P':>2} {'mode':>6} {'added MB':>9} {'goal MB':>8} {'shard MB':>9} "
          f"{'file pages MB':>13}")
    rows = []
    for ranks in map(int, args.ranks.split(",")):
        goal = (size_mb / ranks + largest_mb) * 1.1
        for mode in ("shards", "whole"):
            r = measure(ckpt, ranks, mode, args.work_dir)
            rows.append({"P": ranks, "mode": mode, "goal_mb": goal, "size_mb": size_mb, **r})
            print(f"{ranks:>2} {mode:>6} {r['added_mb']:>9.0f} {goal:>8.0f} "
                  f"{r['shard_mb']:>9.0f} {r['file_mb']:>13.0f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    ok = all(r["added_mb"] <= r["goal_mb"] for r in rows if r["mode"] == "shards")
    print("goal met (shards)" if ok else "goal missed (shards)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
