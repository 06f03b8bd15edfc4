"""The planner's byte formula (``usp.planner.traffic``) counts only the KV heads a rank needs
when GQA replicates them. Measured against real ranks: ``distributed/test_comm_volume.py``."""

from usp.planner.traffic import attention_bytes as expected_bytes


def test_formula_gqa_replication_counts_only_needed_heads():
    # Llama-3-8B-like: 32 q heads, 8 KV heads, u=8 -> each rank gets exactly 1 KV head
    fwd, _ = expected_bytes(1, 8 * 1024, 32, 8, 128, 8, 1, 2)
    per_dest = 1 * 1024 * (4 + 2 * 1) * 128 * 2
    assert fwd["ulysses"] == 7 * per_dest + 7 * 1024 * 4 * 128 * 2
