"""Feasibility rules for a sequence-parallel layout.

Pure functions, no process group: they run before anything is launched and raise
``ValueError`` with the offending numbers and a fix. The mesh, the layout, the attention
call and the planner all use these, so each rule is written once.
"""

from __future__ import annotations


import torch

FIXED_BALANCES = ("contiguous", "zigzag")  # one ownership for every row (usp.dims.tokens)
BALANCES = (*FIXED_BALANCES, "per_document")  # a run's rows: per_document per row's documents
BALANCE_SETTINGS = (*BALANCES, "auto")  # parallel.balance; auto: usp.dims.balance.choose_balance
PLACEMENTS = ("ulysses_inner", "ring_inner")
KERNELS = ("torch", "flash_attn", "reference")  # usp.kernels has one adapter each
RING_IMPLS = ("usp", "ring_flash_attn")
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256  # flash attention (torch's and flash-attn's): d % 8 == 0, d <= 256


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_degrees(world_size: int, ulysses: int, ring: int, dp: int | None = None) -> int:
    """Check ``dp * ring * ulysses == world_size``; return dp (derived when not given)."""
    for name, val in (("ulysses", ulysses), ("ring", ring), ("world_size", world_size)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} degree must be a positive integer, got {val!r}")
    sp = ulysses * ring
    if dp is None:
        if world_size % sp != 0:
            fits = [(u, world_size // u) for u in _divisors(world_size)]
            raise ValueError(
                f"ulysses ({ulysses}) x ring ({ring}) = {sp} does not divide world size "
                f"{world_size}; pick degrees whose product divides {world_size}, "
                f"e.g. (ulysses, ring) in {fits}"
            )
        return world_size // sp
    if dp < 1 or dp * sp != world_size:
        raise ValueError(
            f"dp ({dp}) x ring ({ring}) x ulysses ({ulysses}) = {dp * sp} != world size "
            f"{world_size}; set dp = world_size / (ring * ulysses) or leave it unset"
        )
    return dp


def check_expert_degree(degree: int, world: int, n_experts: int | None,
                        hf: str | None = None) -> None:
    """``parallel.expert_degree`` N: 1, or for the built-in mixture of experts a divisor of
    both the ranks (``world``) and the experts (``n_experts``); ValueError naming the
    numbers and the degrees that would do."""
    if degree == 1:
        return
    if hf is not None or n_experts is None:
        what = f"model.hf={hf} computes transformers' own experts" if hf is not None else \
            "the model has no experts (model.n_experts=null)"
        raise ValueError(f"parallel.expert_degree={degree}: {what}; expert parallelism "
                         "spreads the built-in model's experts; set parallel.expert_degree=1")
    if world % degree or n_experts % degree:
        fits = [d for d in _divisors(world) if n_experts % d == 0]
        raise ValueError(f"parallel.expert_degree={degree} must divide the ranks ({world}) "
                         f"and the experts of each sparse layer (model.n_experts={n_experts})"
                         f"; degrees that do: {fits}")


def seq_multiple(ulysses: int, ring: int, balance: str) -> int:
    """The number the global sequence length must be a multiple of: ``2 * ring * ulysses``
    under zigzag and per_document (each document cut in 2r parts, each ring segment in u
    shares), ``ring * ulysses`` under contiguous."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    return (1 if balance == "contiguous" else 2) * ring * ulysses


def check_seq_len(seq_len: int, ulysses: int, ring: int, balance: str) -> None:
    """Zigzag and per_document need ``2 * ring * ulysses | L``; contiguous needs
    ``ring * ulysses | L``."""
    m = seq_multiple(ulysses, ring, balance)
    if seq_len < 1 or seq_len % m != 0:
        lo = max(m, seq_len // m * m)
        rule = "ring x ulysses" if balance == "contiguous" else "2 x ring x ulysses"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {rule} = {m} "
            f"(ulysses={ulysses}, ring={ring}, balance={balance}); "
            f"use seq_len {lo} or {lo + m}"
        )


def check_balance(balance: str, ring_impl: str, packed: bool) -> None:
    """``per_document`` lays each row out by its packed documents: it needs documents under
    the document mask (``packed``: ``data.packing=documents``) and usp's own ring, which
    runs a row's own plan (ring-flash-attn knows contiguous and zigzag only)."""
    if balance not in BALANCE_SETTINGS:
        raise ValueError(f"parallel.balance must be one of {BALANCE_SETTINGS}, got {balance!r}")
    if balance != "per_document":
        return
    if ring_impl != "usp":
        raise ValueError(f"parallel.balance=per_document runs each row's own ring plan, which "
                         f"only usp's ring does, but parallel.ring_impl={ring_impl}; use "
                         f"parallel.ring_impl=usp, or parallel.balance=zigzag (auto chooses "
                         f"zigzag with {ring_impl})")
    if not packed:
        raise ValueError("parallel.balance=per_document balances the document-masked work of "
                         "packed documents, but data.packing=none gives the rows no documents "
                         "(a row is one causal sequence, which zigzag balances); set "
                         "data.packing=documents, or parallel.balance=auto or zigzag")


def check_ranks_per_node(world_size: int, ranks_per_node: int | None,
                         name: str = "ranks_per_node") -> None:
    """Simulated nodes of ``ranks_per_node`` ranks must split the world evenly (None: real hosts)."""
    if ranks_per_node is not None and (ranks_per_node < 1 or world_size % ranks_per_node):
        raise ValueError(f"{name}={ranks_per_node} does not divide the {world_size} ranks into "
                         f"whole nodes; use a divisor of {world_size} or null")


def check_a2a_setting(chunks, who: str = "a2a_chunks") -> None:
    """``chunks`` is a pipeline depth for the ulysses all-to-alls: an int >= 1 or "auto"
    (the heads' own limit is ``usp.dims.stages.check_a2a_chunks``)."""
    if chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int)
                             or chunks < 1):
        raise ValueError(f"{who}={chunks!r} must be an integer >= 1 or auto; use {who}=auto "
                         f"(1 inside a host, pipelined across a slower link) or {who}=1 "
                         f"(blocking all-to-alls)")


def check_fragment_bytes(fragment_bytes) -> None:
    """``fragment_bytes`` is a message fragment size: a positive int, ``"auto"`` or None (whole)."""
    if fragment_bytes not in (None, "auto") and (isinstance(fragment_bytes, bool)
                                               or not isinstance(fragment_bytes, int)
                                               or fragment_bytes < 1):
        raise ValueError(f"fragment_bytes={fragment_bytes!r} must be a positive number of bytes, "
                         f"auto or None (messages whole)")


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def _check_head_dim(head_dim: int, who: str, max_dim: int | None) -> None:
    if head_dim < 1 or head_dim % 8:
        lo = max(8, head_dim // 8 * 8)
        raise ValueError(
            f"head dim {head_dim} is not a multiple of 8, which {who} needs; "
            f"use head dim {lo} or {lo + 8}"
        )
    if max_dim is not None and head_dim > max_dim:
        raise ValueError(
            f"head dim {head_dim} > {max_dim}, the largest {who} supports; use a head dim "
            f"<= {max_dim} (more heads of a smaller dim)"
        )


def check_ring_impl(
    ring_impl: str,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    causal: bool = True,
    balance: str = "zigzag",
) -> None:
    """Rules for the ring engine: ``usp`` runs anywhere; ``ring_flash_attn`` is the
    ring-flash-attn package (0.1.8) on flash-attn kernels."""
    if ring_impl not in RING_IMPLS:
        raise ValueError(f"ring_impl must be one of {RING_IMPLS}, got {ring_impl!r}")
    if ring_impl == "usp":
        return
    who = "ring_impl='ring_flash_attn'"
    if torch.device(device_type).type != "cuda":
        raise ValueError(
            f"{who} runs flash-attn CUDA kernels, but the tensors are on {device_type}; "
            f"use ring_impl='usp'"
        )
    if dtype not in HALF_DTYPES:
        raise ValueError(
            f"{who} needs float16 or bfloat16 tensors, got {dtype}; train in bf16 or use "
            f"ring_impl='usp'"
        )
    if balance == "zigzag" and not causal:
        raise ValueError(
            f"{who} with balance='zigzag' asserts causal=True (zigzag only balances causal "
            f"work); use balance='contiguous' or ring_impl='usp' for non-causal attention"
        )
    if balance == "contiguous" and dtype == torch.float16:
        raise ValueError(
            f"{who} with balance='contiguous' returns dq in bfloat16 (ring-flash-attn "
            f"0.1.8), losing float16 precision; use bfloat16, balance='zigzag' or "
            f"ring_impl='usp'"
        )
    _check_head_dim(head_dim, f"{who} (flash attention)", FLASH_MAX_HEAD_DIM)


def check_kernel(
    kernel: str,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    ring_impl: str = "usp",
    causal: bool = True,
    balance: str = "zigzag",
) -> None:
    """Check that ``kernel`` (and ``ring_impl``) can run q/k/v of ``dtype`` and ``head_dim``
    on ``device_type`` ("cpu", "cuda"), before anything is launched.

    CUDA: torch's and flash-attn's flash attention take fp16/bf16 with head dim a multiple
    of 8 up to 256; torch's efficient attention (kernel="torch", fp32) takes head dims in
    multiples of 8 here; neither takes fp64. ``reference`` runs anything.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
    device_type = torch.device(device_type).type
    if kernel == "flash_attn":
        if device_type != "cuda":
            raise ValueError(
                f"kernel='flash_attn' is CUDA only, but the tensors are on {device_type}; "
                f"use kernel='torch'"
            )
        if dtype not in HALF_DTYPES:
            raise ValueError(
                f"kernel='flash_attn' needs float16 or bfloat16 tensors, got {dtype}; "
                f"train in bf16 or use kernel='torch'"
            )
        _check_head_dim(head_dim, "kernel='flash_attn'", FLASH_MAX_HEAD_DIM)
    elif kernel == "torch" and device_type == "cuda":
        if dtype == torch.float64:
            raise ValueError(
                "kernel='torch' on CUDA has no float64 attention (flash and efficient "
                "attention take fp16/bf16/fp32); use float32 or kernel='reference'"
            )
        flash = dtype in HALF_DTYPES
        who = f"kernel='torch' on cuda with {dtype} ({'flash' if flash else 'efficient'} attention)"
        _check_head_dim(head_dim, who, FLASH_MAX_HEAD_DIM if flash else None)
    check_ring_impl(ring_impl, device_type, dtype, head_dim, causal, balance)
