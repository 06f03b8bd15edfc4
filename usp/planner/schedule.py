"""How usp overlaps its attention traffic with compute, as the planner prices it: the
pipelined all-to-alls of one pass (``a2a_pass``) and one layer's ring (``ring_pass``), each in
seconds exposed beside the compute that hides them (``usp.planner.cost.attention_cost``)."""

from __future__ import annotations

FLASH_BWD = 2.5  # flash-attention backward FLOPs / forward FLOPs (recomputes P)


def a2a_pass(chunks: int, send_in: float, send_out: float, stage: float,
             overlap: float) -> float:
    """Exposed seconds of one pass's two all-to-alls split over ``chunks`` pipeline stages, as
    ``usp.pipelined.PipelinedAttention`` schedules them: ``send_in``/``send_out``: one stage's
    incoming / outgoing message on the link; ``stage``: one stage's ring pass. The first
    incoming and the last outgoing message wait alone; beside stage t's compute travel the
    next stage's input (t < c-1) and the previous stage's output (t >= 1)."""
    waits = send_in + send_out
    for t in range(chunks):
        beside = (send_in if t < chunks - 1 else 0.0) + (send_out if t >= 1 else 0.0)
        waits += beside - overlap * min(beside, stage)
    return waits


def ring_pass(r: int, n_fwd: int, send_kv: float, send_acc: float, diag: float, block: float,
              merge_f: float, merge_b: float, overlap: float) -> tuple[float, float, float]:
    """One layer's ring traffic as ``usp.ring`` schedules it: (transfer time, exposed time,
    exposed time of the last dK/dV hop), seconds.

    ``send_kv``/``send_acc``: one K/V block / one fp32 dK/dV accumulator on the ring's link;
    ``diag``/``block``: forward compute of the diagonal / of a later block; ``overlap``: the
    share of a transfer that compute beside it can hide. Forward (``n_fwd`` times): r-1 K/V
    hops, each beside a block. Backward: the first K/V hop beside half the diagonal; at
    step s = 1..r-1 the next K/V block (s <= r-2) and the previous rank's accumulator
    (s >= 2) beside the step's block; the last accumulator hop, to the block's owner,
    beside the other half of the owner's diagonal.
    """

    def exposed(send: float, compute: float) -> float:
        return send - overlap * min(send, compute)

    half_diag = FLASH_BWD * diag / 2
    exp_f = (r - 1) * exposed(send_kv, block + merge_f)
    exp_b = exposed(send_kv, half_diag)
    for s in range(1, r):
        in_flight = (send_kv if s <= r - 2 else 0.0) + (send_acc if s >= 2 else 0.0)
        exp_b += exposed(in_flight, FLASH_BWD * block + merge_b)
    tail = exposed(send_acc, half_diag)
    comm = (r - 1) * ((n_fwd + 1) * send_kv + send_acc)
    return comm, n_fwd * exp_f + exp_b + tail, tail
