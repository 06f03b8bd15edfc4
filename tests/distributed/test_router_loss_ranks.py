"""The router's load-balancing loss under sequence parallelism against transformers, on 4 gloo
ranks, Qwen3-MoE at (ulysses, ring) = (2, 2) and gpt-oss at (1, 4): the built-in model of tiny Qwen3-MoE and gpt-oss
checkpoints saved by transformers, their tokens spread over the ranks and each sparse layer's
statistics pooled by ``RouterLedger.settle``, gives the ``aux_loss`` of transformers' own
class run with ``output_router_logits=True`` on the same batch (1e-6 relative), and the
gradients of LM + weight x router loss, summed over the ranks, equal the gradients of
transformers' loss (which adds ``router_aux_loss_coef`` x its aux loss) for every parameter
(1e-4 relative). Only ``prob_sum`` carries the router loss's gradient, through the router to
every layer before it."""

import functools
import json

import pytest
import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.data.packing import IGNORE_INDEX
from usp.launch import spawn_local
from usp.models.families import builtin_model, hf_names
from usp.models.pretrained import load_state, pretrained_config
from usp.models.sparse_mlp import attach_ledger

from _pretrained import hf_model

L, WEIGHT = 32, 0.5
KINDS = ("qwen3_moe", "gpt_oss")


def _data(vocab: int):
    tokens = torch.randint(0, vocab, (2, L), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    return tokens, labels


def _reference(ckpt):
    """transformers' (aux_loss, {its parameter name: grad}) of loss = LM + WEIGHT x aux."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                 attn_implementation="eager")
    tokens, _ = _data(model.config.vocab_size)
    out = model(input_ids=tokens, labels=tokens, output_router_logits=True)
    out.loss.backward()
    return out.aux_loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _worker(ckpts, layouts):
    for (kind, ckpt), (u, r) in zip(ckpts.items(), layouts):
        aux_ref, grads_ref = _reference(ckpt)
        mc = pretrained_config(ckpt)
        theirs = hf_names(mc)  # the built-in model's names -> transformers'
        with SPMesh.build(ulysses=u, ring=r) as mesh:
            layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
            model = builtin_model(mc, functools.partial(usp_attention, mesh=mesh,
                                                        layout=layout, causal=True))
            model.load_state_dict(load_state(mc))
            ledger = attach_ledger(model)
            tokens, labels = _data(mc.vocab_size)
            ledger.open()
            loss_sum, _ = model(layout.shard(tokens), layout.positions(),
                                labels=layout.shard(labels))
            ledger.settle(WEIGHT, mesh.group("sp"))  # no FSDP here: each rank's share
            (loss_sum / (labels != IGNORE_INDEX).sum()).backward()
            where = f"{kind} at (u, r) = ({u}, {r})"
            assert abs(ledger.loss() - aux_ref) < 1e-6 * aux_ref, (where, ledger.loss(),
                                                                   aux_ref)
            assert ledger.busiest() >= 1.0
            for name, p in model.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad, grads_ref[theirs[name]], rtol=1e-4,
                                           atol=1e-6, msg=f"{where}: {name}")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Each family's tiny checkpoint, its routers drawn wide (the routing far from uniform)
    and its config asking for transformers' router loss at WEIGHT."""
    root = tmp_path_factory.mktemp("router")
    out = {}
    for kind in KINDS:
        model = hf_model(kind)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".router.weight" in name or ".gate.weight" in name:
                    p.mul_(25.0)
        model.save_pretrained(root / kind)
        path = root / kind / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "output_router_logits": True,
                                    "router_aux_loss_coef": WEIGHT}))
        out[kind] = str(root / kind)
    return out


def test_router_loss_pooled_over_ranks_is_transformers(ckpts):
    spawn_local(_worker, 4, ckpts, [(2, 2), (1, 4)])
