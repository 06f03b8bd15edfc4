"""bf16 training on gloo ranks is FSDP2 mixed precision: bf16 all-gather and compute, fp32
master shards."""

from functools import partial

import torch
import torch.distributed as dist

from usp.config import ModelConfig
from usp.launch import spawn_local


# --- defect 10: bf16 is FSDP2 mixed precision (bf16 all-gather/compute, fp32 master) ---

def _mixed_precision_worker():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from usp.attention import local_attention
    from usp.models.decoder import Transformer
    from usp.train.build import shard_model

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    for dtype, compute in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = Transformer(cfg, partial(local_attention, causal=True))
        shard_model(model, mesh, dtype)
        seen = {}
        # registered after fully_shard, so these hooks see what FSDP's own pre-forward made
        model.layers[0].register_forward_pre_hook(lambda m, a: seen.update(cos=a[1].dtype))
        model.layers[1].feed_forward.w1.register_forward_pre_hook(
            lambda m, a: seen.update(weight=m.weight.dtype, weight_shape=tuple(m.weight.shape)))
        tokens = torch.randint(0, cfg.vocab_size, (2, 16))
        logits = model(tokens, torch.arange(16))
        logits.float().sum().backward()
        assert seen["weight"] == compute, (dtype, seen)  # the unsharded (all-gathered) weight
        assert seen["weight_shape"] == (cfg.ffn_dim, cfg.dim), seen  # really unsharded
        assert seen["cos"] == torch.float32, (dtype, seen)  # RoPE tables are not cast
        assert logits.dtype == compute, (dtype, logits.dtype)
        for name, p in model.named_parameters():  # sharded master weights and grads: fp32
            assert isinstance(p, DTensor) and p.dtype == torch.float32, (dtype, name, p.dtype)
            assert p.grad is not None and p.grad.dtype == torch.float32, (dtype, name)


def test_bf16_computes_in_bf16_and_keeps_fp32_shards():
    spawn_local(_mixed_precision_worker, 2)
