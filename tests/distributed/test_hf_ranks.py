"""Hugging Face decoders through usp.models.hf on gloo ranks: parity with the unpatched
model, packed documents, sliding windows, and the checkpoint export round trip.

One spawn of 4 gloo ranks loops over (ulysses, ring, dp) in {(1,1,4), (2,1,2), (2,2,1),
(4,1,1), (1,4,1)} and Llama (GQA), Qwen2 (GQA, sliding window on layer 1 only), Mistral
(GQA, sliding window on every layer), at (2,1,2), (2,2,1) and (4,1,1) gpt-oss (attention sinks
passed as s_aux, a window on layer 0, experts) and at (2,2,1) and (4,1,1) Qwen3 (q/k norms,
head_dim 24): gathered logits within 1e-4 (gpt-oss 1e-5) of the unpatched model on the whole
batch in one process, every parameter gradient (summed over dp x sp) within 1e-3 of its
largest entry (the sinks' within 1e-5), and the summed loss shares equal to HF's own loss.
Packed rows (documents marked by position_ids resets) equal each document run alone. The same
spawn writes a usp checkpoint (usp.models.checkpoint) that ``test_export_round_trip`` exports,
and at (1,1,4), (2,2,1) and (1,4,1) checks conversations packed whole (``data.packing=whole``)
with the loss on the assistant's tokens against transformers' own loss, under zigzag and
per_document, ``trainer.loss_norm`` token and document (``_chat_parity.assistant_parity``;
``test_assistant_loss_over_layouts``).
"""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

import usp.models.hf
from usp import SequenceLayout, SPMesh
from usp.models.export import export_checkpoint
from usp.models.run_records import save_config
from usp.launch import spawn_local
from usp.models.checkpoint import save_checkpoint

from _chat_files import write_chat
from _chat_parity import assistant_parity
from _hf_tiny import L, ROWS, TINY, V, tiny_model

LAYOUTS = [(1, 1, "zigzag"), (2, 1, "contiguous"), (2, 2, "zigzag"), (4, 1, "zigzag"),
           (1, 4, "contiguous")]


def _packed_positions(gen) -> torch.Tensor:
    """[ROWS, L] positions restarting at each document: random lengths, one row whole, a
    boundary at 8 (a shard edge for every layout) in row 1."""
    rows = [torch.arange(L)]
    while len(rows) < ROWS:
        cuts = sorted(torch.randperm(L - 3, generator=gen)[:3].add(2).tolist())
        cuts = [c for i, c in enumerate(cuts) if i == 0 or c - cuts[i - 1] >= 2]
        bounds = [0] + cuts + [L]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    rows[1][8:] = torch.arange(L - 8)  # a boundary on a shard edge for every layout
    return torch.stack(rows)


def _reference(ref, ids, pos):
    """logits [ROWS, L, V] and mean loss of the unpatched model; packed rows: each document
    alone (its logits, and its targets counted in the mean)."""
    if pos is None:
        out = ref(input_ids=ids, labels=ids)
        return out.logits.detach(), out.loss
    logits, loss_sum, count = torch.empty(ROWS, L, V), 0.0, 0
    for b in range(ROWS):
        starts = (pos[b] == 0).nonzero().flatten().tolist() + [L]
        for a, e in zip(starts, starts[1:]):
            doc = ids[b:b + 1, a:e]
            out = ref(input_ids=doc, labels=doc if e - a > 1 else None)
            logits[b, a:e] = out.logits[0].detach()
            if e - a > 1:  # a one-token document has no target
                loss_sum = loss_sum + out.loss * (e - a - 1)
                count += e - a - 1
    return logits, loss_sum / count


def _case(mesh: SPMesh, balance: str, kind: str, packed: bool, seed: int):
    model = tiny_model(kind)
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (ROWS, L), generator=gen)
    pos = _packed_positions(gen) if packed else None
    ref_logits, ref_loss = _reference(ref, ids, pos)
    ref_loss.backward()

    layout = SequenceLayout(mesh, seq_len=L, balance=balance)
    usp.models.hf.patch(model, mesh, layout)
    rows = slice(mesh.dp_rank * ROWS // mesh.dp, (mesh.dp_rank + 1) * ROWS // mesh.dp)
    batch = usp.models.hf.shard_batch(layout, input_ids=ids[rows], labels=ids[rows],
                               position_ids=None if pos is None else pos[rows])
    assert ("segment_ids" in batch) == packed
    out = model(**{k: v for k, v in batch.items() if k != "shift_labels"})
    loss, count = usp.models.hf.causal_lm_loss(out.logits, batch["shift_labels"], mesh)
    loss.backward()

    where = f"{kind} (u={mesh.ulysses}, r={mesh.ring}, dp={mesh.dp}, {balance}, packed={packed})"
    err = (layout.gather(out.logits.detach(), dim=1) - ref_logits[rows]).abs().max().item()
    assert err <= (1e-5 if kind == "gpt_oss" else 1e-4), f"{where}: logits differ by {err:.2e}"
    dp_sp = mesh.group("dp_sp")
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp_sp)
    assert abs(total.item() - ref_loss.item()) <= 1e-5, f"{where}: loss {total} vs {ref_loss}"
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=dp_sp)  # each rank holds its tokens' share
        rel = ((g - rp.grad).abs().max() / rp.grad.abs().max()).item()
        bound = 1e-5 if name.endswith(".sinks") else 1e-3  # each rank's share, summed
        assert rel <= bound, f"{where}: grad of {name} off by {rel:.2e} (relative)"
    return model


def _save_a_checkpoint(model, mesh: SPMesh, run_dir: str) -> None:
    """One optimizer step (so the weights differ from any init), then the trainer's save."""
    for p in model.parameters():  # every rank takes the same step, as the trainer does
        dist.all_reduce(p.grad, group=mesh.group("dp_sp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(run_dir, 1, model, opt, sched)
    if dist.get_rank() == 0:
        save_config(model.config, run_dir)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   f"{run_dir}/expected_state.pt")


def _worker(run_dir: str) -> None:
    seed = 0
    for u, r, balance in LAYOUTS:
        with SPMesh.build(ulysses=u, ring=r) as mesh:
            sinks = ("gpt_oss",) if (u, r) in ((2, 1), (2, 2), (4, 1)) else ()
            for kind in ("llama", "qwen2", "mistral") + sinks:
                seed += 1
                model = _case(mesh, balance, kind, packed=False, seed=seed)
            if (u, r) in ((2, 2), (4, 1)):  # q/k norms on whole heads, then heads split
                seed += 1
                _case(mesh, balance, "qwen3", packed=False, seed=seed)
            if (u, r) in ((2, 2), (1, 4)):
                for kind in ("llama", "mistral"):
                    seed += 1
                    model = _case(mesh, balance, kind, packed=True, seed=seed)
            if (u, r) == (2, 2):
                _save_a_checkpoint(model, mesh, run_dir)
            if (u, r) in ((1, 1), (2, 2), (1, 4)):
                assistant_parity(mesh, f"{run_dir}/chat")
                dist.barrier()
                (Path(run_dir) / f"chat_ok_{u}{r}_{dist.get_rank()}").touch()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_run")
    write_chat(path / "chat", np.random.default_rng(5).integers(3, L + 1, 24), vocab=V, seed=5)
    spawn_local(_worker, 4, str(path))
    return path


def test_parity_over_layouts(run_dir):
    assert (run_dir / "checkpoints" / "step_000001" / "manifest.json").is_file()


def test_assistant_loss_over_layouts(run_dir):
    assert len(list(run_dir.glob("chat_ok_*"))) == 3 * 4  # every layout, every rank


def test_export_round_trip(run_dir, tmp_path):
    out_dir = tmp_path / "exported"
    export_checkpoint(run_dir, out_dir)  # the run's newest checkpoint and its hf_config
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir))
    assert (out_dir / "model.safetensors").is_file()
    expected = MistralForCausalLM(MistralConfig(**TINY, sliding_window=5))
    expected.load_state_dict(torch.load(run_dir / "expected_state.pt"))
    fresh = tiny_model("mistral")
    assert type(loaded) is MistralForCausalLM
    ids = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, expected.eval()(input_ids=ids).logits
        init = fresh.eval()(input_ids=ids).logits
    assert torch.equal(got, want)
    assert not torch.allclose(init, want)  # the optimizer step moved the weights
