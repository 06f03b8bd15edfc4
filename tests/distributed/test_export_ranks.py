"""usp-export on real runs: usp-train (2 gloo ranks, 3 steps) of the built-in model (global
RoPE untied -> Llama; windows on some layers, tied -> Qwen2; on every layer -> Mistral)
and of a transformers model (model.hf=qwen2), each exported with the command. The export
gives usp's own logits and loss on a held-out batch (the run's model loaded from its
checkpoint at the run's layout), carries the run's tokenizer or says it has none, and each
bad input is one error line with nothing written."""

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp.config import RunConfig
from usp.launch import spawn_local
from usp.models.export import main
from usp.models.run_records import MODEL_CONFIG
from usp.train.phase_runner import train

from _export_runs import RUNS, TEXT, corpus, memmap, run_cfg
from _hf_runs import checkpointed_model

pytest.importorskip("transformers")
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM", "hf_qwen2": "Qwen2ForCausalLM"}
REFERENCE = "usp_reference.pt"  # in each run directory: usp's logits and loss
LAST = "checkpoints/step_000003"  # each run's one checkpoint


def _reference(cfg: RunConfig) -> None:
    """Rank 0 saves usp's logits [B, L, V] and summed loss on held-out batch 0: the
    run's model built and sharded as the trainer does, loaded from its newest checkpoint."""
    from usp.data.dataset import build_dataset
    from usp.data.indexing import held_out_batch
    from usp.layout import SequenceLayout
    from usp.run import resolve_run
    from usp.models.forward import forward, loss_and_predictions

    run = resolve_run(cfg, dist.get_world_size(), "cpu")
    seq_len = cfg.data.seq_len
    with run.build_mesh() as mesh:
        layout = SequenceLayout(mesh, seq_len=seq_len, balance=run.balance)
        model, opt, sched = checkpointed_model(cfg, run, mesh, layout)
        data = build_dataset(cfg.data, cfg.model)
        positions = layout.positions()
        b = data.model_batch(held_out_batch(0), 2, 0, 1, positions=positions)  # no step drew it
        with torch.no_grad():
            model.eval()
            logits = layout.gather(forward(model, b, positions), dim=1)  # [B, L/P, V] -> [B, L, V]
            loss, _ = loss_and_predictions(model, b, positions)
        dist.all_reduce(loss, group=mesh.group("dp_sp"))  # sum over the sequence shards
        del model, opt, sched
    if dist.get_rank() == 0:
        full = data.model_batch(held_out_batch(0), 2, 0, 1, positions=torch.arange(seq_len))
        torch.save({"tokens": full.tokens, "labels": full.labels, "logits": logits,
                    "loss": loss}, Path(cfg.trainer.run_dir) / REFERENCE)


def _worker(cfgs: dict[str, RunConfig]) -> None:
    for cfg in cfgs.values():
        train(cfg)
        _reference(cfg)


def _export(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each run of ``RUNS`` trained and exported (``usp-export RUN OUT``): name -> run dir;
    the export is ``run/../NAME.hf`` and its printed lines ``run/../NAME.out``."""
    root = tmp_path_factory.mktemp("export")
    corpus(root / "data" / "corpus")
    cfgs = {name: run_cfg(root / name, model=mc, u=u, r=r,
                          data=memmap(root / "data" / "corpus") if tokenized else None)
            for name, (mc, tokenized, u, r) in RUNS.items()}
    spawn_local(_worker, 2, cfgs)
    for name in cfgs:
        rc, out, err = _export(root / name, root / f"{name}.hf")
        assert rc == 0 and err == "", err
        (root / f"{name}.out").write_text(out)
    return {name: root / name for name in cfgs}


@pytest.mark.parametrize("name", RUNS)
def test_the_export_computes_what_usp_computed(runs, name):
    from transformers import AutoModelForCausalLM

    run = runs[name]
    ref = torch.load(run / REFERENCE)
    model = AutoModelForCausalLM.from_pretrained(f"{run}.hf", local_files_only=True).eval()
    assert type(model).__name__ == ARCH[name]
    with torch.no_grad():
        logits = model(input_ids=ref["tokens"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), ref["labels"].flatten(), reduction="sum")
    want = ref["logits"]
    assert (logits - want).abs().max() <= 1e-4 * want.abs().max()
    assert abs(loss - ref["loss"]) <= 1e-4 * ref["loss"]
    tied = RUNS[name][0].tie_embeddings
    assert model.config.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert not torch.allclose(model.model.norm.weight, torch.ones(1))  # trained, not at init
    n = sum(p.numel() for p in model.parameters())
    assert Path(f"{run}.out").read_text().startswith(
        f"usp-export: wrote {ARCH[name]} ({n:,} parameters, float32) from {run / LAST} "
        f"to {run}.hf\n")


def test_the_tokenizer_travels_with_the_export(runs):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    source = AutoTokenizer.from_pretrained(str(runs["llama"].parent / "data" / "corpus.tokenizer"))
    for name in ("llama", "hf_qwen2"):  # the built-in model and a transformers one
        out = f"{runs[name]}.hf"
        tok = AutoTokenizer.from_pretrained(out)
        assert tok(TEXT[2]).input_ids == source(TEXT[2]).input_ids
        config, gen = AutoConfig.from_pretrained(out), GenerationConfig.from_pretrained(out)
        for ids in (config, gen):  # generate() finds its ids; no pad: eos pads
            assert (ids.eos_token_id, ids.bos_token_id, ids.pad_token_id) == \
                (source.eos_token_id, source.bos_token_id, source.eos_token_id)
        lines = Path(f"{runs[name]}.out").read_text().splitlines()
        assert lines[1:] == [f"usp-export: tokenizer: copied from {runs[name] / 'tokenizer'}"]


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_a_run_without_tokenizer_exports_the_model_and_says_why(runs, name):
    lines = Path(f"{runs[name]}.out").read_text().splitlines()
    assert len(lines) == 2 and lines[1].startswith("usp-export: no tokenizer: the run has no ")
    assert "the synthetic recall task" in lines[1]
    assert sorted(p.name for p in Path(f"{runs[name]}.hf").iterdir()) == \
        ["config.json", "generation_config.json", "model.safetensors"]


def test_windowed_generation_with_the_kv_cache_is_generation_without(runs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(f"{runs['qwen2']}.hf").eval()
    prompt = torch.load(runs["qwen2"] / REFERENCE)["tokens"][:1, :16]  # window 12 < 16 + 8
    cached = model.generate(prompt, max_new_tokens=8, do_sample=False)
    uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert model.config.use_cache and torch.equal(cached, uncached)


def test_dtype_casts_the_weights(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    assert _export(runs["llama"], tmp_path / "bf16", "--dtype", "bf16")[0] == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _damage(step: Path) -> None:
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _before_records(run: Path) -> None:
    """The run as usp wrote it before checkpoints kept their own model config and data
    record: those files (and their manifest entries) gone, so the run directory's are read."""
    for step in (run / "checkpoints").glob("step_*"):
        manifest = json.loads((step / "manifest.json").read_text())
        for name in (MODEL_CONFIG, "data_record.json"):
            (step / name).unlink()
            del manifest["files"][name]
        (step / "manifest.json").write_text(json.dumps(manifest))


def _model_config(run: Path, **fields) -> None:
    _before_records(run)
    path = run / MODEL_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _no_model_config(run: Path) -> None:
    _before_records(run)
    (run / MODEL_CONFIG).unlink()


BAD = {  # what is done to a copy of the mistral run -> (what follows RUN, the error)
    "damaged step": (lambda run: _damage(run / LAST), f"/{LAST}",
                     "cannot be trusted: __0_0.distcp fails its sha256"),
    "damaged run": (lambda run: _damage(run / LAST), "", "none of the 1 checkpoints under"),
    "no model config": (_no_model_config, "",
                        "has no model config: neither model_config.json"),
    "unknown model field": (lambda run: _model_config(run, partial_rotary_factor=0.5), "",
                            "fields this usp does not know (partial_rotary_factor)"),
    "other shape": (lambda run: _model_config(run, n_layers=3), "",
                    "does not fit MistralForCausalLM: 9 weights the model config asks for "
                    "are not in the checkpoint"),
    "config for a built-in run": (lambda run: None, " --config {run}", "a config (--config) is "
                                  "for runs of a transformers model"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_input_is_one_error_line_and_nothing_written(runs, tmp_path, case):
    change, tail, needle = BAD[case]
    run = tmp_path / "run"
    shutil.copytree(runs["mistral"], run)
    change(run)
    out = tmp_path / "out"
    where, *more = (str(run) + tail.format(run=run)).split()
    rc, stdout, stderr = _export(where, out, *more)
    assert rc == 2 and stdout == ""
    assert stderr.startswith("usp-export: error: ") and stderr.count("\n") == 1, stderr
    assert needle in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no out, no temporary


def test_a_damaged_newer_checkpoint_is_passed_over_with_a_line(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["mistral"], run)
    newer = run / "checkpoints" / "step_000004"
    shutil.copytree(run / "checkpoints" / "step_000003", newer)
    _damage(newer)
    n = RUNS["mistral"][0].num_params()  # untied, no biases: transformers' count too
    rc, stdout, stderr = _export(run, tmp_path / "out")
    assert rc == 0 and stderr == ""
    assert stdout.splitlines()[:2] == [
        f"usp-export: wrote MistralForCausalLM ({n:,} parameters, float32) from "
        f"{run / LAST} to {tmp_path / 'out'}",
        f"usp-export: checkpoint {newer} is damaged (__0_0.distcp fails its sha256 (same size, "
        "different bytes)); exported step_000003"]



def test_the_checkpoints_own_model_config_is_read_before_the_runs(runs, tmp_path):
    """A run of length phases rewrites the run directory's model config at each phase; each
    checkpoint keeps the one it was trained with, and that is the one exported."""
    run = tmp_path / "run"
    shutil.copytree(runs["mistral"], run)
    path = run / MODEL_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), "n_layers": 3}))
    rc, stdout, stderr = _export(run, tmp_path / "out")
    assert rc == 0 and stderr == "", stderr
    assert stdout.startswith("usp-export: wrote MistralForCausalLM")
