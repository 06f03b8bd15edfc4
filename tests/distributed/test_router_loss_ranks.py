"""The router's load-balancing loss under sequence parallelism, on 4 gloo ranks at (ulysses,
ring) = (2, 2) and (1, 4): a built-in Qwen3-MoE whose tokens are spread over the ranks, each
sparse layer's statistics pooled by ``RouterLedger.settle``, gives transformers' loss on the
whole sequence (``usp.models.moe_loss.balance_loss`` of one process, which
``unit/test_moe.py`` holds to transformers' ``load_balancing_loss_func``), and the gradients
of LM + weight x router loss, summed over the ranks, equal one process's autograd of the
same (every parameter). Only ``prob_sum`` carries the loss's gradient, through the router to
every layer before it."""

import functools

import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.attention import local_attention
from usp.config import ModelConfig
from usp.data.packing import IGNORE_INDEX
from usp.launch import spawn_local
from usp.models.moe import MoeBlock
from usp.models.moe_loss import balance_loss
from usp.models.qwen3_moe.model import Qwen3Moe
from usp.models.sparse_mlp import SparseMlp, attach_ledger

L, WEIGHT = 32, 0.5
CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48,
                  qk_norm=True, n_experts=8, experts_per_token=2, expert_ffn_dim=16,
                  norm_topk_prob=True, sparse_layers=[0, 2])


def _data():
    tokens = torch.randint(0, CFG.vocab_size, (2, L), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    return tokens, labels


def _model(attn):
    model = Qwen3Moe(CFG, attn)
    model.init_weights(7)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # routers far from uniform: the loss has something to balance
        for block in model.layers:
            if isinstance(block.feed_forward, MoeBlock):
                block.feed_forward.router.weight.normal_(0.0, 0.5, generator=gen)
    return model


def _reference():
    """(LM mean + WEIGHT x router loss, the router loss, every gradient) in one process."""
    model = _model(functools.partial(local_attention, causal=True))
    stats = []

    def routed(self, x):
        y, s = MoeBlock.forward(self, x)
        stats.append(s)
        return y

    SparseMlp._routed, original = routed, SparseMlp._routed
    try:
        tokens, labels = _data()
        loss_sum, _ = model(tokens, torch.arange(L), labels=labels)
        aux = balance_loss(stats, CFG.n_experts)
        ((loss_sum / (labels != IGNORE_INDEX).sum()) + WEIGHT * aux).backward()
    finally:
        SparseMlp._routed = original
    return aux.item(), {n: p.grad for n, p in model.named_parameters()}


def _worker(layouts):
    aux_ref, grads_ref = _reference()
    for u, r in layouts:
        with SPMesh.build(ulysses=u, ring=r) as mesh:
            layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
            attn = functools.partial(usp_attention, mesh=mesh, layout=layout, causal=True)
            model = _model(attn)
            ledger = attach_ledger(model)
            tokens, labels = _data()
            ledger.open()
            loss_sum, _ = model(layout.shard(tokens), layout.positions(),
                                labels=layout.shard(labels))
            ledger.settle(WEIGHT, mesh.group("sp"))  # no FSDP here: each rank's own share
            (loss_sum / (labels != IGNORE_INDEX).sum()).backward()
            assert abs(ledger.loss() - aux_ref) < 1e-6 * aux_ref, (u, r, ledger.loss(), aux_ref)
            for name, p in model.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad, grads_ref[name], rtol=1e-4, atol=1e-6,
                                           msg=f"(u, r) = ({u}, {r}): {name}")
            assert ledger.busiest() >= 1.0


def test_router_loss_pooled_over_ranks_is_one_process():
    spawn_local(_worker, 4, [(2, 2), (1, 4)])
