"""usp-train model=pretrained model.pretrained=DIR at (ulysses, ring) = (2, 2), for tiny
Llama (llama3 scaling), Qwen2 (biases, windowed layers), Mistral (a window), Qwen3 (q/k
norms, its own head_dim) and Gemma 3 4B-27B layout (``gemma3``: its text model beside a vision
tower; its own blocks, a RoPE per layer type, raised on both) checkpoints saved by
transformers, the last two with the LM head in chunks and the MLP in tiles (the built-in
Qwen3-MoE and gpt-oss, their experts at several expert degrees and layouts:
e2e/test_moe_commands.py; the 1B Gemma 3 layout, ``gemma3_text``, the same model under other names, is covered in one process, its
export included: unit/test_gemma3_text.py, unit/test_gemma3.py): step 0's val_loss is
transformers' mean loss on the same windows (with the checkpoint's RoPE, a raised rope_theta,
YaRN), a few steps train (the Qwen3 and the Gemma 3 the same at (1,1) and (4,1)), and bad
checkpoints are refused before any rank starts, printed once, with nothing
written."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from _cli import run_commands
from _export_runs import corpus
from _pretrained import GEMMA_ROPE, KINDS, hf_val_loss, run_args, save_checkpoint, usp_logits

L = 32
YARN = "{rope_type:yarn,factor:4,original_max_position_embeddings:8}"
# name -> (checkpoint, overrides, transformers' rope_parameters: None = the checkpoint's)
# the mixtures of experts on the built-in model: e2e/test_moe_commands.py; through model.hf,
# transformers' classes: distributed/test_hf_ranks.py (gpt-oss's sinks and experts at three
# layouts against the unpatched model) and test_hf_train_ranks.py (usp-train's path)
RUNS = {kind: (kind, [], None) for kind in KINDS
        if kind not in ("gemma3_text", "qwen3_moe", "gpt_oss")}
RUNS["llama_yarn"] = ("llama", ["model.rope_theta=2000000", f"model.rope_scaling={YARN}"],
                      {"rope_theta": 2e6, "rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 8})
TILED = ["model.loss_chunk=4", "model.mlp_tiles=2"]  # 2 chunks and tiles of a (2,2) shard
RUNS["qwen3"] = ("qwen3", TILED, None)
# both layer types' bases raised (the full layers keep their linear factor)
RUNS["gemma3"] = ("gemma3", [*TILED, "model.rope_theta=2000000", "model.local_rope_theta=20000"],
                  {"full_attention": {**GEMMA_ROPE["full_attention"], "rope_theta": 2e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}})
# the same run at other layouts, dp 1 (the same batches): the first of each is at (2,2)
LAYOUTS = {f"{kind}_{u}x{r}": (u, r) for kind in ("qwen3", "gemma3")
           for u, r in ((1, 1), (4, 1))}
for name, (u, r) in LAYOUTS.items():
    kind = name.rsplit("_", 1)[0]
    RUNS[name] = (kind, [*RUNS[kind][1], f"parallel.ulysses_degree={u}",
                         f"parallel.ring_degree={r}", "parallel.ranks_per_node=null",
                         f"trainer.nprocs={u * r}"], RUNS[kind][2])


def _args(root: Path, name: str, ckpt: Path, extra=()) -> list[str]:
    return run_args(root, name, ckpt, L, 2, extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    ckpts = {k: save_checkpoint(k, root / "ckpt" / k) for k in KINDS}
    corpus(root / "corpus", 4096)
    corpus(Path(f"{root / 'corpus'}.val"), 1024)
    calls = [("train_main", _args(root, name, ckpts[k], extra))
             for name, (k, extra, _) in RUNS.items()]
    return root, ckpts, dict(zip(RUNS, run_commands(calls, root, timeout=900)))


@pytest.mark.parametrize("name", RUNS)
def test_step_0_val_loss_is_transformers_and_the_run_trains(runs, name):
    root, ckpts, res = runs
    r = res[name]
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [0, 1, 2]
    kind, _, rope = RUNS[name]
    want = hf_val_loss(root, ckpts[kind], L, rope)
    assert recs[0]["val_loss"] == pytest.approx(want, rel=1e-4)
    assert "step=0 val_loss=" in r.stdout
    assert all(np.isfinite(x["loss"]) for x in recs[1:])
    if name == "llama_yarn":
        assert "rope_theta 500000 -> 2000000" in r.stdout
    if name == "gemma3":
        assert "rope_theta 200000 -> 2000000 (full_attention layers)" in r.stdout
        assert "local_rope_theta 5000 -> 20000 (sliding_attention layers)" in r.stdout


def _losses(root: Path, name: str) -> list[float]:
    recs = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in recs if "loss" in x]


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_train_the_same_at_1x1_2x2_and_4x1(runs, kind):
    """The q/k norms, Gemma 3's blocks and RoPE per layer type under Ulysses (heads split over
    4 ranks at (4,1)) and the ring, the chunked LM head and the tiled MLP change no loss: each
    step's within 1e-5."""
    root, _, res = runs
    others = [name for name in LAYOUTS if name.startswith(kind + "_")]
    assert len(others) == 2 and all(res[name].returncode == 0 for name in (kind, *others))
    want = _losses(root, kind)
    assert len(want) == 2
    for name in others:
        assert _losses(root, name) == pytest.approx(want, rel=1e-5), name


@pytest.mark.parametrize("name", ["qwen2", "llama_yarn", "qwen3", "gemma3"])
def test_the_export_is_the_checkpoints_architecture_with_the_new_rope(runs, name, tmp_path,
                                                                      capsys):
    """usp-export writes the architecture the run came from (a Qwen2 keeps its biases, a Qwen3
    its q/k norms and head_dim, a Gemma 3 its layer types and attention scale: its text model
    alone, gemma3_text, saying the vision tower is not carried over), the run's rope_theta /
    rope_parameters (Gemma's per layer type), max_position_embeddings = the trained (or
    YaRN's scaled) length and the data's tokenizer; transformers reproduces usp's logits."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from usp.models.export import main

    root, ckpts, _ = runs
    assert main([str(root / name), str(tmp_path / "out")]) == 0
    hc = AutoConfig.from_pretrained(tmp_path / "out")
    kind, _, rope = RUNS[name]
    assert hc.model_type == {"gemma3": "gemma3_text"}.get(kind, kind)
    said = capsys.readouterr().out
    assert ("vision tower and its projector of model.pretrained=" in said) == (kind == "gemma3")
    if rope is not None:
        assert hc.rope_parameters == rope and hc.max_position_embeddings == 32  # 4 x 8
    else:
        assert hc.max_position_embeddings == L
        assert getattr(hc, "layer_types", ["full_attention"])[0] == "full_attention"
    if kind == "qwen3":
        assert (hc.head_dim, hc.layer_types[2]) == (24, "sliding_attention")
    if kind == "gemma3":
        assert (hc.query_pre_attn_scalar, hc.sliding_window, hc.layer_types) == (
            20, 6, ["sliding_attention", "full_attention", "sliding_attention"])
    assert AutoTokenizer.from_pretrained(tmp_path / "out") is not None
    tokens = torch.randint(0, 90, (2, L), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=tokens).logits
    want = usp_logits(root / name, tokens)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def _bad_dirs(root: Path, good: Path) -> dict[str, Path]:
    import shutil

    dirs = {name: root / "bad" / name for name in ("empty", "no_weights", "gpt2", "damaged",
                                                   "small_vocab")}
    dirs["empty"].mkdir(parents=True)
    for name in ("no_weights", "gpt2", "damaged", "small_vocab"):
        dirs[name].mkdir(parents=True)
        shutil.copy(good / "config.json", dirs[name])
    (dirs["gpt2"] / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (dirs["damaged"] / "model.safetensors").write_bytes(
        (good / "model.safetensors").read_bytes()[:5000])
    cfg = json.loads((good / "config.json").read_text())
    (dirs["small_vocab"] / "config.json").write_text(json.dumps({**cfg, "vocab_size": 64}))
    shutil.copy(good / "model.safetensors", dirs["small_vocab"])
    return dirs


def _capped(root: Path, gemma: Path) -> Path:
    """The Gemma 3 checkpoint with final_logit_softcapping, which transformers applies to the
    logits and the built-in model does not."""
    import shutil

    path = root / "bad" / "softcap"
    shutil.copytree(gemma, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 30.0}))
    return path


REFUSED = {  # name -> (directory, extra overrides, the error's words)
    "empty": ("empty", [], "no config.json there"),
    "no_weights": ("no_weights", [], r"has no weights (*.safetensors)"),
    "gpt2": ("gpt2", [], "is a 'gpt2' model; usp maps llama, qwen2, mistral"),
    "damaged": ("damaged", [], "model.safetensors is damaged"),
    "shape": ("mistral", ["model.n_heads=8"], "n_heads: 8 set, 4 in the checkpoint"),
    "vocab": ("small_vocab", [], "is larger than the embedding"),
    "rope_type": ("mistral", ["model.rope_scaling={rope_type:ntk,factor:2}"],
                  "rope_scaling.rope_type='ntk' is not one of"),
    "factor": ("mistral", ["model.rope_scaling={rope_type:linear}"],
               "with rope_type linear needs factor"),
    "softcap": ("softcap", [], "final_logit_softcapping=30.0: the built-in Gemma 3"),
}


def test_bad_checkpoints_are_refused_once_before_any_rank_with_nothing_written(runs):
    root, ckpts, _ = runs
    dirs = {**_bad_dirs(root, ckpts["mistral"]), "mistral": ckpts["mistral"],
            "softcap": _capped(root, ckpts["gemma3_text"])}
    calls = [("train_main", _args(root, f"refused_{name}", dirs[d], extra))
             for name, (d, extra, _) in REFUSED.items()]
    for (name, (_, _, words)), r in zip(REFUSED.items(), run_commands(calls, root / "bad")):
        assert r.returncode == 2, (name, r.stderr[-2000:])
        lines = [x for x in r.stderr.splitlines() if "usp-train: error:" in x]
        assert len(lines) == 1 and words in lines[0], (name, r.stderr[-2000:])
        assert not (root / f"refused_{name}").exists(), name
