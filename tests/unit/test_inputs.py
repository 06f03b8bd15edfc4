"""Every bad input is refused in the launching process, before any rank starts, with the
offending value in the message. The CLIs printing it as one line:
``e2e/test_inputs_commands.py``."""

import importlib.util
import os
import sys
import types

import pytest
import torch
from hydra import compose, initialize_config_dir

import usp.cli as cli
import usp.launch
import usp.launch.job
from usp.config import ModelConfig
from usp.planner import BatchSpec, ClusterSpec, plan
from usp.run import resolve_run
from usp.dims.heads import check_heads


@pytest.fixture(scope="module")
def hydra_init():
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        yield


@pytest.fixture
def launch(hydra_init, monkeypatch, tmp_path):
    """``launch(*overrides)``: compose ``usp-train``'s config and run the local launch, with
    every way of starting a rank replaced by a failure."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)

    def started(*a, **kw):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", started)
    monkeypatch.setattr(torch.multiprocessing, "spawn", started)
    monkeypatch.setattr(usp.launch, "spawn_local", started)
    monkeypatch.setattr(usp.launch, "run_local", started, raising=False)
    monkeypatch.setattr(usp.launch.job, "run_local", started)  # the one launch usp-train uses

    def run(*overrides):
        base = ["logging.wandb=disabled", f"trainer.run_dir={tmp_path / 'run'}"]
        cfg = cli.to_config(compose("train", overrides=base + list(overrides)))
        cli.run_training(cfg)

    return run


def test_a_good_config_gets_as_far_as_starting_ranks(launch):
    """The premise of the refusals below: without them, ``launch`` starts ranks."""
    with pytest.raises(AssertionError, match="a rank was started"):
        launch("trainer.steps=3", "data.seq_len=128")


BAD = [
    # trainer
    ("trainer.steps=0", "trainer.steps=0 must be >= 1"),
    ("trainer.steps=-5", "trainer.steps=-5 must be >= 1"),
    ("trainer.ckpt_every=-1", "trainer.ckpt_every=-1 must be >= 0"),
    ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints=0 must be >= 1"),
    ("trainer.timeout_s=0", "trainer.timeout_s=0.0 must be > 0"),
    ("trainer.timeout_s=-3", "trainer.timeout_s=-3.0 must be > 0"),
    ("trainer.max_restarts=-1", "trainer.max_restarts=-1 must be >= 0"),
    ("trainer.log_every=-1", "trainer.log_every=-1 must be >= 0"),
    ("trainer.nprocs=0", "trainer.nprocs=0 must be >= 1"),
    ("trainer.preempt_signals='SIGTERM,SIGFOO'", "SIGFOO is not a signal name here"),
    ("trainer.preempt_signals=SIGKILL", "SIGKILL cannot be caught"),
    ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite='ignore' is not one of stop, skip"),
    ("trainer.dtype=fp16", "trainer.dtype='fp16' is not one of fp32, bf16"),
    ("trainer.stop_after=0", "trainer.stop_after=0 is outside 1..trainer.steps=600"),
    ("trainer.stop_after=700", "trainer.stop_after=700 is outside 1..trainer.steps=600"),
    # optim
    ("optim.lr=-1", "optim.lr=-1.0 must be > 0"),
    ("optim.lr=0", "optim.lr=0.0 must be > 0"),
    ("optim.min_lr=0.1", "optim.min_lr=0.1 > optim.lr=0.002"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be >= 0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be >= 0"),
    ("optim.beta1=1.0", "optim.beta1=1.0 must be < 1"),
    ("optim.beta2=-0.5", "optim.beta2=-0.5 must be >= 0"),
    ("optim.grad_clip=0", "optim.grad_clip=0.0 must be > 0"),
    # data
    ("data.batch_per_dp_rank=0", "data.batch_per_dp_rank=0 must be >= 1"),
    ("data.seq_len=0", "data.seq_len=0 must be >= 1"),
    ("data.eval_batches=-1", "data.eval_batches=-1 must be >= 0"),
    ("data.n_queries=0", "data.n_queries=0 must be >= 1"),
    ("data.n_pairs=0", "data.n_pairs=0 must be >= 1"),
    ("data.n_queries=9", "data.n_queries=9 > data.n_pairs=8"),
    ("data.kind=text", "data.kind='text' does not name this data config (recall); choose the "
                       "dataset with the group: data=recall or data=memmap"),
    ("data=memmap data.path=null", "data.path is not set"),
    ("data=memmap data.seq_len=0", "data.seq_len=0 must be >= 1"),
    ("data.n_queries=8 data.seq_len=64", "data.kind=recall: query section (2*n_queries+1 = 17"),
    # model
    ("model.n_kv_heads=0", "model.n_kv_heads=0 must be >= 1"),
    ("model.dim=0", "model.dim=0 must be >= 1"),
    ("model.n_layers=0", "model.n_layers=0 must be >= 1"),
    ("model.vocab_size=-1", "model.vocab_size=-1 must be >= 1"),
    ("model.ffn_dim=0", "model.ffn_dim=0 must be >= 1"),
    ("model.norm_eps=0", "model.norm_eps=0.0 must be > 0"),
    # parallel
    ("parallel.kernel=bogus", "unknown attention kernel 'bogus'"),
    ("parallel.ring_impl=bogus", "parallel.ring_impl='bogus' is not one of usp, ring_flash_attn"),
    ("parallel.balance=bogus", "parallel.balance='bogus' is not one of contiguous, zigzag"),
    ("parallel.placement=bogus", "parallel.placement='bogus' is not one of ulysses_inner"),
    ("parallel.ranks_per_node=3", "parallel.ranks_per_node=3 does not divide "
                                           "the 4 ranks"),
    ("parallel.ranks_per_node=0", "parallel.ranks_per_node=0 must be >= 1"),
    ("parallel.a2a_chunks=5", "a2a_chunks=5 > 4 query heads per ulysses rank"),
    ("parallel.a2a_chunks=0", "parallel.a2a_chunks=0 must be an integer >= 1 or auto"),
    # logging
    ("logging.wandb=bogus", "logging.wandb='bogus' is not one of offline, online, disabled"),
    # keys the schema lacks
    ("+trainer.foo=1", "unknown config key trainer.foo"),
    ("+model.n_kv_head=1", "model.n_kv_head (did you mean model.n_kv_heads?)"),
    ("data=memmap data.blend=[{path:a}] +data.blend.0.wieght=2",  # inside a list of dicts
     "unknown config key data.blend[0].wieght (did you mean data.blend[0].weight?)"),
]


@pytest.mark.parametrize("overrides,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_launch(launch, overrides, needle):
    with pytest.raises(ValueError) as e:
        launch(*overrides.split())
    assert needle in str(e.value)


def test_a_run_dir_under_a_file_is_refused(launch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError) as e:
        launch(f"trainer.run_dir={blocker}/run")
    assert f"trainer.run_dir={blocker}/run cannot be a directory: {blocker} is a file" in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_run_dir_is_refused(launch, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=f"trainer.run_dir={ro}/run is not writable"):
        launch(f"trainer.run_dir={ro}/run")


def test_ring_flash_attn_without_the_package_is_refused(monkeypatch):
    from usp.config import ParallelConfig, RunConfig, TrainerConfig

    monkeypatch.delitem(sys.modules, "ring_flash_attn", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ring_flash_attn" else real(name, *a))
    cfg = RunConfig(parallel=ParallelConfig(ulysses_degree=1, ring_degree=2,
                                            ring_impl="ring_flash_attn"),
                    trainer=TrainerConfig(nprocs=2, device="cuda", dtype="bf16"))
    with pytest.raises(ValueError, match="ring_impl=ring_flash_attn needs the ring-flash-attn "
                                         "package.*or use parallel.ring_impl=usp"):
        resolve_run(cfg, 2, "cuda")
    monkeypatch.setitem(sys.modules, "ring_flash_attn", types.ModuleType("ring_flash_attn"))
    run = resolve_run(cfg, 2, "cuda")
    assert (run.ulysses, run.ring) == (1, 2)  # with the package, the same config passes


# ---- the planner: dropped layouts summarised, its error in one line -------------------------


@pytest.fixture
def h100():
    return ClusterSpec(name="h100_ib", ranks_per_node=8, nodes=128, intra_bw=450e9, inter_bw=50e9,
                       peak_flops=989e12, mem_bytes=80 * 2**30, mfu=0.5, hbm_bw=3.35e12)


LLAMA = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                    ffn_dim=14336, tie_embeddings=False)


def test_many_dropped_layouts_are_summarised_by_rule(h100):
    from usp.planner.ranking import RULES

    # 1024 ranks, one sequence in all (global_batch=1): every dp > 1 cannot take a share
    p = plan(LLAMA, h100, 1 << 20, batch=BatchSpec(global_batch=1))
    assert len(p.dropped) > 20
    assert {d.rule for d in p.dropped} == {"batch", "heads"}
    assert all("does not split over dp" in d.reason for d in p.dropped if d.rule == "batch")
    for d in (d for d in p.dropped if d.rule == "heads"):  # the heads rule's own message
        with pytest.raises(ValueError) as e:
            check_heads(LLAMA.n_heads, LLAMA.n_kv_heads, d.ulysses)
        assert d.reason == str(e.value), d
    lines = p.format_table().splitlines()
    assert f"dropped: {len(p.dropped)} layouts, by rule" in lines
    counts = {ln.split(":")[0].strip(): int(ln.split()[1]) for ln in lines
              if ln.startswith("  ") and ln.strip().split(":")[0] in RULES}
    assert sum(counts.values()) == len(p.dropped) and set(counts) == {"batch", "heads"}
    assert len(lines) < len(p.candidates) + 12  # not one line per dropped layout
    full = p.format_table(max_dropped=len(p.dropped))  # small enough: one line per layout
    assert sum("does not split over dp" in ln for ln in full.splitlines()) == counts["batch"]


def test_no_feasible_layout_is_one_line_per_rule(h100):
    with pytest.raises(ValueError) as e:
        plan(LLAMA, h100.replace(nodes=4), 1001)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("no feasible layout for world 32, seq_len 1001: ")
    assert "seq_len refused" in msg and "sequence length 1001 is not divisible" in msg
