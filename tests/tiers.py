"""The tier of every test: what it needs to run, read by ``conftest.py`` as pytest markers.

    unit         one process, no process group, no Python subprocess (checked while it runs)
    distributed  gloo process groups: ranks spawned by ``spawn_local``/``run_local``/torchrun
    e2e          a user's command in a subprocess: ``usp-train``/``usp-plan``, a tool, an example
    root         a simulated cluster (``tools.simcluster``: root, ip, tc, unshare)
    gpu          needs CUDA; skipped with the reason on a machine without it

``fast`` marks every unit test plus the distributed tests in ``FAST``: the quick run,
``python -m pytest -q -m fast``. Keys are a file name (its default tier) or
``file::function`` (that function, every parametrisation); a test file missing from
``TIERS`` stops the collection with an error naming it.
"""

from __future__ import annotations

UNIT, DISTRIBUTED, E2E, ROOT, GPU = "unit", "distributed", "e2e", "root", "gpu"
NAMES = (UNIT, DISTRIBUTED, E2E, ROOT, GPU)

TIERS: dict[str, str] = {
    "test_a2a_chunks.py": UNIT,
    "test_a2a_chunks.py::test_chunked_world_2": DISTRIBUTED,
    "test_a2a_chunks.py::test_chunked_world_4": DISTRIBUTED,
    "test_agreement.py": DISTRIBUTED,
    "test_attention_parity.py": DISTRIBUTED,
    "test_bench_report.py": UNIT,
    "test_calibration.py": UNIT,
    "test_checkpoint_files.py": DISTRIBUTED,  # the ``template`` fixture spawns 2 ranks
    "test_checkpoint_files.py::test_check_resume_names_every_changed_key": UNIT,
    "test_checkpoint_files.py::test_check_resume_refuses_each_fingerprint_field": UNIT,
    "test_checkpoint_files.py::test_check_resume_accepts_a_changed_parallel_layout": UNIT,
    "test_clean_exit.py": DISTRIBUTED,
    "test_clean_exit.py::test_library_example_exits_cleanly": E2E,  # torchrun examples/
    "test_clean_exit.py::test_unclosed_mesh_is_released_before_interpreter_shutdown": E2E,
    "test_cli.py": UNIT,  # Hydra composition in-process
    "test_cli.py::test_cli_end_to_end_with_overrides": E2E,
    "test_cli.py::test_cli_refuses_bad_input_before_launch": E2E,
    "test_cli.py::test_usp_plan_cli": E2E,
    "test_comm_gpu_contract.py": UNIT,
    "test_comm_gpu_contract.py::test_host_staging_keeps_results_exact": DISTRIBUTED,
    "test_comm_gpu_contract.py::test_second_call_makes_no_index_tensors": DISTRIBUTED,
    "test_comm_gpu_contract.py::test_ring_p2p_runs_on_the_ring_group": DISTRIBUTED,
    "test_comm_gpu_contract.py::test_kernel_preflight_runs_before_any_collective": DISTRIBUTED,
    "test_comm_volume.py": DISTRIBUTED,
    "test_comm_volume.py::test_formula_gqa_replication_counts_only_needed_heads": UNIT,
    "test_data.py": UNIT,
    "test_detect.py": UNIT,
    "test_dp.py": DISTRIBUTED,
    "test_evaluate.py": DISTRIBUTED,
    "test_fault_campaign.py": E2E,  # real usp-train runs, signalled and killed
    "test_faults_trainer.py": UNIT,
    "test_faults_trainer.py::test_signal_on_one_rank_checkpoints_all_and_resume_matches":
        DISTRIBUTED,
    "test_faults_trainer.py::test_inf_loss_stops_before_the_bad_steps_checkpoint": DISTRIBUTED,
    "test_faults_trainer.py::test_skip_mode_skips_exactly_the_bad_step": DISTRIBUTED,
    "test_gpu.py": GPU,
    "test_gpu_check.py": UNIT,
    "test_gpu_check.py::test_dry_run_end_to_end": E2E,  # python -m usp.bench.gpu_check --dry-run
    "test_inputs.py": UNIT,  # spawn_local replaced by a recorder
    "test_inputs.py::test_usp_train_refuses_in_one_line": E2E,
    "test_inputs.py::test_usp_plan_refuses_in_one_line": E2E,
    "test_kernel_contracts.py": UNIT,
    "test_kernels.py": UNIT,
    "test_launch.py": UNIT,
    "test_launch.py::test_torchrun_end_to_end": E2E,  # torchrun -m usp.cli
    "test_launch_once.py": UNIT,  # set_device / init_process_group replaced by recorders
    "test_launch_once.py::test_usp_train_refuses_cuda_without_gpu": E2E,
    "test_launch_once.py::test_torchrun_ranks_take_rank0s_degrees_and_share_refusals":
        DISTRIBUTED,
    "test_mesh_layout.py": DISTRIBUTED,
    "test_mesh_layout.py::test_mesh_ranks_pure": UNIT,
    "test_model.py": UNIT,
    "test_packing.py": UNIT,
    "test_packing.py::test_packed_model_across_ranks_and_training": DISTRIBUTED,
    "test_planner.py": UNIT,
    "test_restarts.py": DISTRIBUTED,  # run_local, its launcher in a subprocess, torchrun
    "test_ring_plan.py": UNIT,
    "test_simcluster.py": ROOT,
    "test_simcluster.py::test_refuses_when_tc_is_missing": E2E,  # refusals: no root needed
    "test_simcluster.py::test_refuses_when_not_root": UNIT,
    "test_simcluster.py::test_rate_parsing": UNIT,
    "test_simcluster.py::test_queue_reaches_every_shaped_link_and_a_bad_one_is_refused": UNIT,
    "test_tiers.py": UNIT,
    "test_layers.py": UNIT,
    "test_run_layout.py": UNIT,
    "test_train.py": DISTRIBUTED,
    "test_train_gpu_contract.py": UNIT,
    "test_train_gpu_contract.py::test_bf16_computes_in_bf16_and_keeps_fp32_shards": DISTRIBUTED,
    "test_uneven_heads.py": UNIT,
    "test_masks.py": UNIT,
    "test_masks_parity.py": DISTRIBUTED,
    "test_bench_attention.py": UNIT,
    "test_uneven_heads.py::test_parity_world_4": DISTRIBUTED,
    "test_uneven_heads.py::test_parity_world_3": DISTRIBUTED,
    "test_uneven_heads.py::test_parity_world_8": DISTRIBUTED,
    "test_validate.py": UNIT,
    "test_hf.py": UNIT,
    "test_hf.py::test_parity_over_layouts": DISTRIBUTED,  # one spawn of 4 ranks (fixture)
    "test_hf.py::test_export_round_trip": DISTRIBUTED,
    "test_hf_train.py": UNIT,
    "test_hf_train.py::test_hf_llama_trains_the_same_at_1x1_and_2x2_resumes_and_exports":
        DISTRIBUTED,
    "test_tiling.py": UNIT,
    "test_memory_features.py": DISTRIBUTED,
    "test_memory_plan.py": UNIT,
    "test_memory_bench.py": UNIT,
    "test_memory_bench.py::test_measured_step_runs_on_ranks": DISTRIBUTED,
    "test_chunk_gain.py": UNIT,
}

# Distributed tests in the fast selection: 2-10 s each on 2 cores, and between them every
# mechanism (mesh, layout, all-to-all + ring parity, agreement, byte counts, close, eval).
FAST: frozenset[str] = frozenset({
    "test_agreement.py",
    "test_attention_parity.py::test_parity",
    "test_attention_parity.py::test_bad_shapes_raise_before_any_collective",
    "test_clean_exit.py::test_close_frees_groups_and_refuses_use",
    "test_comm_volume.py",
    "test_evaluate.py",
    "test_mesh_layout.py",
})


def tier_of(file: str, function: str) -> str | None:
    """The tier of ``file::function`` (a ``file::function`` key wins over ``file``'s);
    None when the file is not listed."""
    return TIERS.get(f"{file}::{function}", TIERS.get(file))


def is_fast(file: str, function: str, tier: str) -> bool:
    return tier == UNIT or f"{file}::{function}" in FAST or file in FAST
