"""Mixtures of experts through usp-train model=pretrained on tiny checkpoints saved by
transformers, a Qwen3-MoE (8 experts, top 2, layer 1 dense) and a gpt-oss (8 experts with
biases, top 2, sinks, a band on layers 0 and 2, YaRN), both on usp's built-in model with the
LM head in chunks, the MLP in tiles, activation checkpointing and the router's
load-balancing loss (weight 0.5):

- at (ulysses, ring) = (2, 2), expert degree 1 (every rank holds every expert) and 4 (two
  experts a rank, tokens sent to them by all-to-all): step 0's val_loss is transformers'
  mean loss on the same windows (1e-4);
- three steps give the same losses (1e-5) and router losses at both degrees, at (1, 1)
  (degree 1) and at (4, 1) (degree 4);
- a Qwen3-MoE checkpoint written at degree 4 resumes at degree 2 (DCP reshards the experts)
  and gives the same last step;
- usp-export of each degree-4 run reloads as the checkpoint's ``model_type`` with usp's
  logits.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from _cli import run_commands
from _export_runs import corpus
from _pretrained import hf_val_loss, run_args, save_checkpoint, usp_logits

L = 32
FEATURES = ["model.loss_chunk=4", "model.mlp_tiles=2", "trainer.activation_checkpointing=true",
            "model.router_aux_loss_coef=0.5"]
ONE_NODE = ["parallel.ranks_per_node=null"]
KINDS = ("qwen3_moe", "gpt_oss")
LAYOUTS = {  # name -> overrides, for each family
    "e1": ["parallel.expert_degree=1"],
    "e4": ["parallel.expert_degree=4", "trainer.ckpt_every=2", "trainer.keep_checkpoints=2"],
    "e1_1x1": ["parallel.ulysses_degree=1", "parallel.ring_degree=1", "trainer.nprocs=1",
               *ONE_NODE],
    "e4_4x1": ["parallel.ulysses_degree=4", "parallel.ring_degree=1", "parallel.expert_degree=4",
               *ONE_NODE],
}
RUNS = {f"{kind}_{name}": (kind, extra) for kind in KINDS for name, extra in LAYOUTS.items()}


def _args(root: Path, name: str, ckpt: Path, extra=()) -> list[str]:
    return run_args(root, name, ckpt, L, 3, [*FEATURES, *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    ckpts = {kind: save_checkpoint(kind, root / "ckpt" / kind) for kind in KINDS}
    corpus(root / "corpus", 4096)
    corpus(Path(f"{root / 'corpus'}.val"), 1024)
    calls = [("train_main", _args(root, name, ckpts[kind], extra))
             for name, (kind, extra) in RUNS.items()]
    res = dict(zip(RUNS, run_commands(calls, root, timeout=1200)))
    # the Qwen3-MoE degree-4 run's step-2 checkpoint, resumed at degree 2 for its last step
    shutil.copytree(root / "qwen3_moe_e4", root / "e2_resumed")
    shutil.rmtree(root / "e2_resumed" / "checkpoints" / "step_000003")
    resume = _args(root, "e2_resumed", ckpts["qwen3_moe"],
                   ["parallel.expert_degree=2", "trainer.resume=true"])
    res["e2_resumed"], = run_commands([("train_main", resume)], root, timeout=300)
    return root, ckpts, res


def _records(root: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", KINDS)
def test_step_0_val_loss_is_transformers_at_expert_degrees_1_and_4(runs, kind):
    root, ckpts, res = runs
    want = hf_val_loss(root, ckpts[kind], L)
    for name in (f"{kind}_e1", f"{kind}_e4"):
        assert res[name].returncode == 0, res[name].stderr[-3000:]
        recs = _records(root, name)
        assert [x["step"] for x in recs] == [0, 1, 2, 3]
        assert recs[0]["val_loss"] == pytest.approx(want, rel=1e-4), name


@pytest.mark.parametrize("kind", KINDS)
def test_losses_agree_across_expert_degrees_and_layouts(runs, kind):
    """The LM loss and the router loss of each step, and the last validation loss, within
    1e-5 at every layout and degree; the router loss and expert load are logged each step,
    the expert exchanges' bytes and time where experts are spread."""
    root, _, res = runs
    names = [f"{kind}_{layout}" for layout in LAYOUTS]
    assert all(res[n].returncode == 0 for n in names), {n: res[n].stderr[-2000:] for n in names
                                                        if res[n].returncode}
    want = _records(root, f"{kind}_e1")
    assert all(x["aux_loss"] > 1.0 and x["expert_load"] >= 1.0 for x in want[1:])
    assert "expert_a2a_mb" not in want[1]
    assert all(x["expert_a2a_mb"] > 0 for x in _records(root, f"{kind}_e4")[1:])
    for name in names[1:]:
        got = _records(root, name)
        for key in ("loss", "aux_loss"):
            assert [x[key] for x in got[1:]] == pytest.approx([x[key] for x in want[1:]],
                                                              rel=1e-5), (name, key)
        assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=1e-5), name
    assert "aux_loss=" in res[f"{kind}_e4"].stdout and "expert_comm_s=" in res[f"{kind}_e4"].stdout


def test_a_degree_4_checkpoint_resumes_at_degree_2(runs):
    root, _, res = runs
    assert res["e2_resumed"].returncode == 0, res["e2_resumed"].stderr[-3000:]
    assert "resumed from" in res["e2_resumed"].stdout
    last = _records(root, "e2_resumed")[-1]
    want = _records(root, "qwen3_moe_e4")[-1]
    assert last["step"] == 3
    for key in ("loss", "aux_loss", "val_loss"):
        assert last[key] == pytest.approx(want[key], rel=1e-5), key


@pytest.mark.parametrize("kind", KINDS)
def test_the_export_of_a_degree_4_run_has_its_experts_and_usps_logits(runs, kind, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from usp.models.export import main

    root, _, _ = runs
    assert main([str(root / f"{kind}_e4"), str(tmp_path / "out")]) == 0
    hc = AutoConfig.from_pretrained(tmp_path / "out")
    experts = hc.num_experts if kind == "qwen3_moe" else hc.num_local_experts
    assert (hc.model_type, experts, hc.num_experts_per_tok, hc.output_router_logits,
            hc.router_aux_loss_coef) == (kind, 8, 2, True, 0.5)
    if kind == "qwen3_moe":
        assert hc.mlp_only_layers == [1]
    tokens = torch.randint(0, 90, (2, L), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=tokens).logits
    want = usp_logits(root / f"{kind}_e4", tokens)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
