"""Hydra app: each configs/ group option composes to its typed dataclass, a default is written
once (in the dataclass), every recipe composes and validates, typos are errors. The CLI
run as a command: ``e2e/test_cli_commands.py``."""

import dataclasses
from functools import partial
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

import usp.cli as cli
from usp.config import (DATA_KINDS, ClusterSpec, LoggingConfig, ModelConfig, OptimConfig,
                        ParallelConfig, RecallData, RunConfig, TrainerConfig)
from usp.planner import load_cluster
from usp.config.model import EXECUTION_FIELDS
from usp.data.dataset import check_vocab
from usp.planner.report import plan_run
from usp.config import phase_config
from usp.planner.batch import grad_accum_steps
from usp.planner.phase_report import phases_report
from usp.run import (check_passkey_memory, decide_balance, decide_degrees, decide_expert_degree,
                     resolve_run)
from usp.run.decide import detected_cluster
from usp.rules import check_degrees, check_seq_len
from usp.dims.heads import check_heads

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
GROUPS = {g: sorted(p.stem for p in (ROOT / "configs" / g).glob("*.yaml"))
          for g in ("model", "parallel", "cluster", "data", "optim", "trainer", "logging")}
SCHEMA = {"model": ModelConfig, "parallel": ParallelConfig, "cluster": ClusterSpec,
          "optim": OptimConfig, "trainer": TrainerConfig, "logging": LoggingConfig}


def _compose(name="train", overrides=()):
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        return cli.to_config(compose(name, overrides=list(overrides)))


def _schema(group: str, option: str) -> type:
    return DATA_KINDS[option] if group == "data" else SCHEMA[group]


def _values(group: str, option: str) -> dict:
    """What ``configs/<group>/<option>.yaml`` sets (its ``defaults`` list aside)."""
    raw = yaml.safe_load((ROOT / "configs" / group / f"{option}.yaml").read_text()) or {}
    raw.pop("defaults", None)
    return raw


def _field_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _default_options() -> dict[str, str]:
    """group -> the option configs/train.yaml picks."""
    entries = yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())["defaults"]
    return {g: o for e in entries if isinstance(e, dict) for g, o in e.items() if g in GROUPS}


def test_there_are_the_promised_recipes():
    assert {"tiny_cpu", "llama3_8b_128k_h100x16", "qwen2_7b_256k_h100x32"} <= set(RECIPES)
    assert len(RECIPES) >= 4


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_is_feasible(recipe):
    # an _extend_ or _phases_ recipe requires its checkpoint and data, a memmap recipe its
    # data (the user's data.path); stated shapes plan without them
    raw = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    needs = ["model.pretrained=/absent/ckpt", "data.path=/absent/tokens"] \
        if "_extend_" in recipe or "_phases_" in recipe \
        else ["data.path=/absent/tokens"] if {"override /data": "memmap"} in raw.get("defaults", []) \
        else []
    cfg = _compose(overrides=[f"recipe={recipe}", *needs])
    world = cfg.cluster.nodes * cfg.cluster.ranks_per_node
    if recipe == "tiny_cpu":
        world = cfg.trainer.nprocs
        run = resolve_run(cfg, world, "cpu")
        assert (run.ulysses, run.ring) == (2, 2)
        return
    u, r = cfg.parallel.ulysses_degree, cfg.parallel.ring_degree
    if u == "auto" or r == "auto":
        u, r, _, table = decide_degrees(cfg, world, env={})
        assert "ulysses" in table
    check_degrees(world, u, r)
    check_heads(cfg.model.n_heads, cfg.model.n_kv_heads, u)
    check_seq_len(cfg.data.seq_len, u, r, decide_balance(cfg)[0])
    assert u <= cfg.cluster.ranks_per_node  # ulysses stays inside a node


def test_recipe_specifics():
    big = _compose(overrides=["recipe=llama3_8b_128k_h100x16"])
    assert (big.parallel.ulysses_degree, big.parallel.ring_degree, big.cluster.nodes) == (8, 2, 2)
    assert big.data.seq_len == 131072 and big.model.n_kv_heads == 8
    q = _compose(overrides=["recipe=qwen2_7b_256k_h100x32"])
    assert q.model.n_kv_heads == 4 and q.parallel.ring_degree * q.parallel.ulysses_degree == 32
    assert q.parallel.ulysses_degree <= q.model.n_kv_heads < q.parallel.ring_degree
    auto = _compose(overrides=["recipe=llama3_8b_1m_auto_h100x32"])
    assert decide_degrees(auto, 32, env={})[:2] == (8, 4)


def test_the_gemma3_recipe_plans_its_local_layers_before_the_checkpoint_exists():
    """recipes/gemma3_12b_extend_128k_h100x16 (Gemma-3-12B's text model as released, model.arch
    gemma3): usp-plan plans it with model.pretrained and data.path absent, 16 q heads over 8 KV
    heads split by ulysses 8 (2 and 1 a rank) x ring 2, its 40 local layers priced at their
    band of 1024 (its shape against the released config.json: unit/test_gemma3.py)."""
    from usp.planner.report import plan_report

    recipe = ["recipe=gemma3_12b_extend_128k_h100x16", "model.pretrained=/absent/ckpt",
              "data.path=/absent/tokens"]
    cfg = _compose("plan", recipe)
    assert (cfg.model.arch, cfg.model.n_heads, cfg.model.n_kv_heads) == ("gemma3", 16, 8)
    text, _ = plan_report(cfg)
    assert "layers: 8 full + 40 local (window 1024: attention 0.0156 of a full layer's)" in text
    assert "choice: dp 1 x ring 2 x ulysses 8" in text
    assert "longest seq_len that fits this layout" in text


def test_the_moe_recipes_plan_their_experts_or_say_why_not():
    """recipes/qwen3_30b_a3b_extend_128k_h100x16 (128 experts, top-8, on 2 x 8 H100, degrees
    and expert degree auto): usp-plan ranks the expert degrees beside the layouts and prints
    the experts' terms; recipes/gpt_oss_20b_extend_128k_h100x8 (the built-in gpt-oss: 32 experts,
    top-4, on 1 x 8 H100) plans its experts too."""
    from usp.planner.report import plan_report

    absent = ["model.pretrained=/absent/ckpt", "data.path=/absent/tokens"]
    cfg = _compose("plan", ["recipe=qwen3_30b_a3b_extend_128k_h100x16", *absent])
    assert (cfg.model.n_experts, cfg.parallel.expert_degree) == (128, "auto")
    text, _ = plan_report(cfg)
    assert " #  dp ring ulysses expert    s/seq" in text
    assert "experts: 48 sparse layers x 128 experts of 768, top-8: 28.99B expert weights" in text
    assert "expert degree 1 of [1, 2, 4, 8, 16]" in text
    assert "experts over 16 ranks across nodes" in text  # ranked, on the inter-node link
    assert "x expert " in text.split("choice: ")[1].splitlines()[0]
    run = _compose(overrides=["recipe=qwen3_30b_a3b_extend_128k_h100x16", *absent])
    u, r, dp, _ = decide_degrees(run, 16, env={})
    expert = decide_expert_degree(run, 16, u, r, dp, partial(detected_cluster, run, 16, None, {}))
    assert 16 % expert == 0 and 128 % expert == 0
    assert f"choice: dp {dp} x ring {r} x ulysses {u} x expert {expert}" in text
    with pytest.raises(ValueError, match=r"expert_degree=3 must divide the ranks \(16\)"):
        decide_expert_degree(dataclasses.replace(run, parallel=dataclasses.replace(
            run.parallel, expert_degree=3)), 16)
    oss = _compose("plan", ["recipe=gpt_oss_20b_extend_128k_h100x8", *absent])
    assert (oss.model.arch, oss.model.n_experts, oss.model.attention_sinks) == ("gpt_oss", 32,
                                                                               True)
    text, _ = plan_report(oss)
    assert "experts: 24 sparse layers x 32 experts of 2880, top-4" in text
    assert "x expert " in text.split("choice: ")[1].splitlines()[0]


def test_the_phases_recipe_plans_every_phase():
    """8K -> 32K -> 128K on 4 x 8 H100, 1M tokens a step: usp-plan plans each phase, the
    batch in tokens forces a smaller dp at 128K, and each phase's passkey forward fits
    beside the training state on its layout."""
    recipe = ["recipe=llama3_8b_phases_8k_to_128k_h100x32", "model.pretrained=/absent/ckpt",
              "data.path=/absent/tokens"]
    text, _ = phases_report(_compose("plan", recipe))
    headings = [line for line in text.splitlines() if line.startswith("phase ")]
    assert headings[0] == "phase 1/3: seq_len 8192, steps 1..500, rope_theta 500000"
    assert headings[2].startswith("phase 3/3: seq_len 131072, steps 1501..3500, rope_theta "
                                  "8000000, until passkey_acc >= 0.9 and val_loss_within 0.02")
    assert "trainer.steps 3500 = 500 + 1000 + 2000" in text
    assert ("phase 3 (131072): ulysses 1 x ring 1 x dp 32 of phase 2 no longer fits "
            "(trainer.global_batch_tokens is 8 sequences a step") in text
    cfg = _compose(overrides=recipe)
    assert cfg.trainer.phases[2].until.passkey_acc == 0.9 and cfg.eval.during_training
    layouts = []
    for k in range(3):
        phase = phase_config(cfg, k)
        u, r, dp, _ = decide_degrees(phase, 32, env={})
        check_passkey_memory(phase, dp, r, u, "cuda")
        assert grad_accum_steps(phase.trainer, phase.data.seq_len, 1, dp) * dp * \
            phase.data.seq_len == 1048576
        layouts.append((dp, r, u))
    assert layouts[0] == layouts[1] != layouts[2] and layouts[2][0] == 8


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_group_option_composes_to_its_values(group):
    """Each option becomes its group's dataclass holding the schema defaults overlaid with
    exactly what the file sets (a cluster: what the planner's own reader makes of it)."""
    for option in GROUPS[group]:
        if (group, option) == ("model", "pretrained"):  # needs a checkpoint: test_pretrained.py
            continue
        got = getattr(_compose(overrides=["~recipe", f"{group}={option}"]), group)
        cls = _schema(group, option)
        want = (load_cluster(option) if group == "cluster"
                else cls(**{**_field_defaults(cls), **_values(group, option)}))
        assert type(got) is cls and got == want, (group, option, got, want)


def test_default_options_hold_no_values():
    """A default is written once, in the dataclass: the option train.yaml picks sets nothing
    (the cluster group has no default option: ClusterSpec's defaults describe unknown hardware)."""
    defaults = _default_options()
    assert set(defaults) == set(GROUPS)
    for group, option in defaults.items():
        if group == "cluster":
            continue
        assert _values(group, option) == {}, f"configs/{group}/{option}.yaml restates defaults"
        composed = _compose(overrides=["~recipe", f"{group}={option}"])
        assert getattr(composed, group) == _schema(group, option)()
    assert ModelConfig().vocab_size == 320  # the tiny model's vocabulary: fits the recall task


def test_other_options_set_only_what_differs():
    """Options other than the default set only values that differ from the dataclass, so a
    default change reaches them; model and cluster options state a whole shape or machine."""
    defaults = _default_options()
    fields = {g: {f.name for f in dataclasses.fields(c)} for g, c in SCHEMA.items()}
    fields["model"] -= set(EXECUTION_FIELDS)  # memory choices, not the shape: recipes set them
    for group, options in GROUPS.items():
        for option in options:
            values = _values(group, option)
            if group == "cluster" or (group == "model" and option != defaults[group]):
                assert set(values) == fields[group], (group, option, set(values) ^ fields[group])
                continue
            base = _field_defaults(_schema(group, option))
            same = {k: v for k, v in values.items() if base[k] == v}
            assert not same, f"configs/{group}/{option}.yaml restates defaults {same}"


def test_the_default_run_is_every_default_plus_tiny_cpu():
    cfg = _compose()
    assert type(cfg) is RunConfig
    assert cfg == RunConfig(parallel=ParallelConfig(ranks_per_node=2),
                            cluster=load_cluster("cpu_local"), data=RecallData(),
                            trainer=TrainerConfig(device="cpu"))
    plan = _compose("plan", overrides=["nodes=2"])
    assert (type(plan).__name__, plan.nodes, plan.data.batch_per_dp_rank,
            plan.parallel.ulysses_degree, plan.trainer.dtype) == (
        "PlanConfig", 2, 1, "auto", "bf16")


def test_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        c = compose("train", overrides=["hydra/launcher=slurm", "recipe=llama3_8b_128k_h100x16"],
                    return_hydra_config=True)
    launcher = c.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)


def test_typos_and_bad_values_are_errors():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose(overrides=["parallel.ulysess_degree=2"])
    with pytest.raises(Exception, match="dim"):
        _compose(overrides=["model.dim=abc"])
    with pytest.raises(ValueError, match=r"model.rope_scaling=yarn names the type"):
        _compose(overrides=["model.rope_scaling=yarn"])
    from usp.config.rope import EXAMPLES

    for name, example in EXAMPLES.items():  # what the refusal suggests composes
        scaling = _compose(overrides=[f"model.rope_scaling={example}"]).model.rope_scaling
        assert scaling["rope_type"] == name and scaling["factor"] > 1


def test_the_planner_prices_the_global_batch_of_the_run():
    """usp-plan and usp-train ask the planner the same question: batch_per_dp_rank x dp
    sequences, in trainer.dtype."""

    cfg = _compose("plan", overrides=["model=llama3_8b", "cluster=h100_ib", "nodes=4",
                                      "data.seq_len=131072", "data.batch_per_dp_rank=3",
                                      "parallel.dp_degree=2"])
    spec = cfg.cluster.replace(nodes=cfg.nodes)
    p = plan_run(cfg, spec, spec.world)
    assert p.global_batch == 6 and {c.dp for c in p.candidates} == {2}
    fp32 = plan_run(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, dtype="fp32")),
                    spec, spec.world)
    mem32 = {(c.ring, c.ulysses): c.cost.mem_bytes for c in fp32.candidates}
    both = [c for c in p.candidates if (c.ring, c.ulysses) in mem32]
    assert both and all(mem32[c.ring, c.ulysses] > c.cost.mem_bytes for c in both)  # bf16 < fp32


def test_vocab_size_auto_takes_the_data_vocabulary(tmp_path):
    from usp.data.files import TokenWriter

    prefix = tmp_path / "tokens"
    with TokenWriter(prefix, 70_000, "test", "test") as w:
        w.write_document(list(range(0, 70_000, 7)))
    cfg = _compose(overrides=["data=memmap", f"data.path={prefix}", "model.vocab_size=auto"])
    assert cfg.model.vocab_size == 70_000 and type(cfg.model) is ModelConfig
    plan = _compose("plan", overrides=["data=memmap", f"data.path={prefix}",
                                       "model.vocab_size=auto"])
    assert plan.model.vocab_size == 70_000
    with pytest.raises(ValueError, match=r"vocab_size=auto takes the vocabulary of token files, "
                                         r"and data=recall has none"):
        _compose(overrides=["model.vocab_size=auto"])
    with pytest.raises(FileNotFoundError, match=r"nowhere.bin not found.*usp-prepare"):
        _compose(overrides=["data=memmap", f"data.path={tmp_path / 'nowhere'}",
                            "model.vocab_size=auto"])
    with pytest.raises(ValueError, match=r"model.vocab_size='big' is neither a whole number "
                                         r"nor auto"):
        _compose(overrides=["model.vocab_size=big"])
    # a model smaller than the data: both numbers and the fix, from the metadata alone
    small = _compose(overrides=["data=memmap", f"data.path={prefix}", "model.vocab_size=512"])
    with pytest.raises(ValueError, match=r"has vocab_size 70000 > model.vocab_size 512.*set "
                                         r"model.vocab_size=70000 \(or model.vocab_size=auto\)"):
        check_vocab(small.data, small.model)


def test_a_blend_on_the_command_line():
    cfg = _compose(overrides=["data=memmap",
                              "data.blend=[{path: a, weight: 0.7}, {path: b, weight: 0.3}]"])
    assert cfg.data.sources() == [("a", 0.7), ("b", 0.3)] and cfg.data.path is None
    with pytest.raises(ValueError, match=r"data.path=c and data.blend \(2 sources\) are "
                                         r"exclusive.*data.path=null"):
        _compose(overrides=["data=memmap", "data.path=c",
                            "data.blend=[{path: a, weight: 0.7}, {path: b, weight: 0.3}]"])
    with pytest.raises(ValueError, match=r"data.blend\[1\].weight=0.0 must be > 0"):
        _compose(overrides=["data=memmap", "data.blend=[{path: a}, {path: b, weight: 0}]"])
    with pytest.raises(ValueError, match=r"data.path is not set.*or give data.blend"):
        _compose(overrides=["data=memmap"]).data.sources()


def test_usp_plan_speaks_of_the_global_batch_and_fits_it_in_memory():
    from usp.planner.report import plan_report

    big = ["model=llama3_8b", "cluster=h100_ib", "nodes=4", "data.seq_len=8192"]
    text, _ = plan_report(_compose("plan", overrides=[*big, "trainer.global_batch_tokens=2097152"]))
    # 8 sequences per dp rank: 8 or 4 at once do not fit 80 GB (with accumulation FSDP also
    # holds 30 GiB of unsharded fp32 gradients), 2 at once x 4 micro-batches do
    assert ("global batch: 256 sequences = 2097152 tokens per optimizer step (batch_per_dp_rank "
            "1 x dp 32 x grad_accum_steps 8)") in text
    assert "largest per-rank batch that fits is data.batch_per_dp_rank=2 with " \
           "trainer.grad_accum_steps=4" in text
    long = ["model=llama3_8b", "cluster=h100_ib", "nodes=4", "data.seq_len=131072",
            "trainer.global_batch_tokens=2097152"]
    text, _ = plan_report(_compose("plan", overrides=long))
    assert "FSDP holds the unsharded fp32 gradients (29.9 GiB)" in text
    assert "trainer.global_batch_tokens=1048576 (one sequence per dp rank" in text
    small = ["cluster=h100_ib", "nodes=1", "data.seq_len=1024", "parallel.ulysses_degree=8",
             "parallel.ring_degree=1", "trainer.global_batch_tokens=4096"]
    text, _ = plan_report(_compose("plan", overrides=small))
    assert "data.batch_per_dp_rank=4 with trainer.grad_accum_steps=1" in text  # all fit
    text, _ = plan_report(_compose("plan", overrides=[*big, "trainer.global_batch_tokens=1000"]))
    assert "is no whole number of sequences for each of dp 32 ranks" in text


def test_the_sft_recipe_plans_its_chunks_and_tiles_before_checkpoint_and_data_exist():
    """recipes/qwen3_8b_sft_128k_h100x16 (conversations at 128K: whole rows, the assistant's
    loss, per_document RoPE and balance, loss_chunk and mlp_tiles auto): usp-plan plans it
    with model.pretrained and data.path absent (the planner's auto keys read neither) and
    says the chunk and tiles it sized."""
    from usp.planner.report import plan_report

    absent = ["model.pretrained=/absent/ckpt", "data.path=/absent/chats"]
    cfg = _compose("plan", ["recipe=qwen3_8b_sft_128k_h100x16", *absent])
    assert (cfg.data.packing, cfg.data.loss_on, cfg.model.rope) == ("whole", "assistant",
                                                                    "per_document")
    text, _ = plan_report(cfg)
    assert "choice: dp 1 x ring 2 x ulysses 8" in text
    assert "model.loss_chunk=auto -> " in text and "model.mlp_tiles=auto -> " in text


@pytest.mark.parametrize("ranks,nodes,seq_len", [(1, 1, 500_000), (8, 1, 3_700_000),
                                                 (8, 4, 15_000_000)])
def test_alst_lengths_plan_with_the_offloads_and_auto_tilings(ranks, nodes, seq_len):
    """Llama-3.1-8B at ALST's lengths (500K on 1 H100, 3.7M on 8, 15M on 32) with the
    offloads and auto chunk and tiles, as issue 52's command asks: usp-plan finds a layout
    under the budget (docs/memory.md's table; the norms and the attention backward split by
    size, usp.dims.work, with no key for them)."""
    import re

    from usp.planner.report import plan_report

    cfg = _compose("plan", [
        "model=llama3_8b", "cluster=h100_ib", f"cluster.ranks_per_node={ranks}",
        f"nodes={nodes}", f"data.seq_len={seq_len}", "model.loss_chunk=auto",
        "model.mlp_tiles=auto", "trainer.activation_checkpointing=true",
        "trainer.activation_offload=true", "trainer.state_offload=true"])
    text, _ = plan_report(cfg)
    got = re.search(r"total ([\d.]+) GiB of ([\d.]+) GiB", text)
    assert "choice: dp 1 x ring" in text and float(got.group(1)) <= float(got.group(2))
