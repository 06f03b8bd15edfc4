"""gpt-oss on the built-in model over 4 gloo ranks, as training builds it (``routed_model`` on
the meta device, FSDP2 over dp x sp with the experts spread over expert groups,
``load_shards``: each rank reads its rows, its 2 of the 8 experts): the tiny checkpoint of
unit/test_gpt_oss.py at (ulysses, ring) = (2, 2) zigzag, expert degree 2, and its MXFP4 copy
(each rank dequantizes its own experts' bytes) at (4, 1), expert degree 4: the
gathered logits equal transformers' eager GptOssForCausalLM (of the MXFP4 copy: of its twin
with transformers' dequantized experts) within 1e-5, the summed loss within 1e-5, and every
parameter's gradient (the sinks' through ulysses and the ring, the experts' FSDP-reduced)
within 1e-4 of its largest entry."""

import pytest
import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh
from usp.launch import spawn_local
from usp.models.families import hf_names
from usp.models.pretrained import pretrained_config
from usp.models.routed import routed_model
from usp.models.shard_load import load_shards
from usp.train.build import shard_model

from _pretrained import save_checkpoint, save_mxfp4

L, B = 32, 2
# (ulysses, ring, balance, expert degree) of the checkpoint, then of its MXFP4 copy
LAYOUTS = ((2, 2, "zigzag", 2), (4, 1, "contiguous", 4))
CHANGES = dict(num_local_experts=8, swiglu_limit=0.1, swiglu_alpha=1.5)  # unit/test_gpt_oss.py


def _reference(path, ids, labels) -> dict:
    """transformers' logits, summed loss and each built-in parameter's gradient."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager")
    logits = hf(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             reduction="sum")
    loss.backward()
    params = dict(hf.named_parameters())
    grads = {usp: params[name].grad for usp, name in hf_names(pretrained_config(path)).items()}
    return dict(logits=logits.detach(), loss=loss.item(), grads=grads)


def _case(mesh: SPMesh, balance: str, experts: int, path: str, ids, labels, want: dict) -> None:
    mc = pretrained_config(path)
    layout = SequenceLayout(mesh, seq_len=L, balance=balance)
    model, _, _ = routed_model(mc, mesh, dict(kernel="torch"), 0, layout)
    shard_model(model, mesh.submesh("fsdp"), "fp32", experts=(mesh, experts))
    load_shards(model, mc, "cpu")  # this rank's rows: 2 of the 8 experts
    positions = layout.positions()
    logits = model(layout.shard(ids), positions)
    where = f"{path} (u={mesh.ulysses}, r={mesh.ring}, {balance}, expert degree {experts})"
    err = (layout.gather(logits.detach(), dim=1) - want["logits"]).abs().max()
    assert err <= 1e-5 * want["logits"].abs().max(), f"{where}: logits off by {err:.2e}"
    loss, _ = model(layout.shard(ids), positions, labels=layout.shard(labels))
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert abs(total.item() - want["loss"]) <= 1e-5 * want["loss"], f"{where}: loss {total}"
    (loss * dist.get_world_size()).backward()  # FSDP averages over the ranks: the sum
    for name, p in model.named_parameters():
        got, ref = p.grad.full_tensor(), want["grads"][name]
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, f"{where}: grad of {name} off by {rel:.2e} (relative)"


def _worker(cases: list, ids, labels) -> None:
    for (u, r, balance, experts), (path, want) in zip(LAYOUTS, cases):
        with SPMesh.build(ulysses=u, ring=r) as mesh:
            _case(mesh, balance, experts, path, ids, labels, want)


@pytest.mark.timeout(300)
def test_the_built_in_gpt_oss_on_four_ranks_is_transformers(tmp_path):
    ckpt = save_checkpoint("gpt_oss", tmp_path / "ckpt", **CHANGES)
    save_mxfp4(ckpt, tmp_path / "mxfp4", tmp_path / "twin")
    ids = torch.randint(0, 128, (B, L), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    cases = [(str(ckpt), _reference(ckpt, ids, labels)),
             (str(tmp_path / "mxfp4"), _reference(tmp_path / "twin", ids, labels))]
    spawn_local(_worker, 4, cases, ids, labels)
