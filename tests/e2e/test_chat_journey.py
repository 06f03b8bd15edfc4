"""A chat fine-tuning journey (issue 53's done-when, the CI size of docs/data.md's
miniature): conversations whose user turn hides a key among random letters
(``tools/chat_corpus``, a ChatML template without generation markers) -> usp-prepare (the
assistant's loss mask) -> usp-train at ring 2 with whole conversations per row -> usp-export
-> transformers' ``apply_chat_template(..., add_generation_prompt=True)`` and greedy
``generate`` answer held-out conversations (chance 10%)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.chat_corpus import answer, write
from usp.data.prepare import main as prepare_main
from usp.models.export import main as export_main

pytest.importorskip("transformers")
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
STEPS = 100


def test_conversations_to_a_chat_model_that_answers(tmp_path, capsys):
    src = tmp_path / "src"
    write(src, 1200, 50, (8, 60), 0.3, seed=0)
    prefix = tmp_path / "data" / "chat"
    assert prepare_main(["--src", str(src / "train"), "--glob", "*.jsonl", "--out", str(prefix),
                         "--tokenizer", str(src / "tokenizer"), "--val-fraction", "0.05",
                         "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "chat: 1200 conversations" in said and "assistant tokens" in said
    meta = json.loads(Path(f"{prefix}.json").read_text())
    assert meta["loss_kind"] == "assistant" and meta["loss_tokens"] > 0

    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD"))}
    r = subprocess.run(
        [str(BIN / "usp-train"), "data=memmap", f"data.path={prefix}", "data.seq_len=128",
         "data.packing=whole", "data.batch_per_dp_rank=8", "model.vocab_size=auto",
         "model.rope=per_document", "parallel.ulysses_degree=1", "parallel.ring_degree=2",
         "trainer.nprocs=2", f"trainer.steps={STEPS}", "optim.warmup_steps=10",
         "logging.wandb=disabled", "logging.progress=false", "logging.plot=false",
         "logging.jsonl=true", f"trainer.run_dir={run}", f"hydra.run.dir={tmp_path / 'h'}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "packed whole into" in r.stdout and "0 longer than data.seq_len dropped" in r.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    losses = [d["loss"] for d in records if "loss" in d]
    assert len(losses) == STEPS and losses[-1] < 0.1, losses[-10:]  # the assistant's tokens only

    out = tmp_path / "export"
    assert export_main([str(run), str(out)]) == 0
    assert (out / "chat_template.jinja").is_file()
    share = answer(out, src / "held_out.jsonl")
    assert share >= 0.9, share
