"""The pure layer (``usp.dims``) and the planner (``usp.planner``) import no
``torch.distributed``, directly or through another usp module (imports inside functions
included): a cost model and a layout need no process group. Read from the source with
``test_layers.graph``; nothing is imported. Then ``ParallelDims``'s own rules."""

from __future__ import annotations

import ast

import pytest
from test_layers import graph, modules

from usp.dims.parallel import ParallelDims

PURE = ("usp.dims", "usp.planner")


def _uses_distributed(path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(
                a.name.split(".")[:2] == ["torch", "distributed"] for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module.startswith("torch.distributed")
                or (node.module == "torch" and any(a.name == "distributed" for a in node.names))):
            return True
    return False


def _reaching(g: dict[str, set[str]], direct: set[str]) -> dict[str, list[str]]:
    """Each module that reaches a module of ``direct``: the import path to the first one."""
    out = {}
    for start in g:
        seen, todo = {start: [start]}, [start]
        while todo:
            m = todo.pop(0)
            if m in direct:
                out[start] = seen[m]
                break
            for t in sorted(g.get(m, ())):
                if t in g and t not in seen:
                    seen[t] = seen[m] + [t]
                    todo.append(t)
    return out


def test_pure_layer_and_planner_reach_no_torch_distributed():
    known = modules()
    g = graph()
    direct = {name for name, path in known.items() if _uses_distributed(path)}
    assert "usp.mesh" in direct  # the check sees a real user
    reach = _reaching(g, direct)
    bad = sorted(" -> ".join(path) for name, path in reach.items()
                 if any(name == p or name.startswith(p + ".") for p in PURE))
    assert not bad, "the pure layer reaches torch.distributed:\n" + "\n".join(bad)


def test_the_check_sees_a_module_reached_through_another():
    g = {"usp.dims.a": {"usp.dims.b"}, "usp.dims.b": {"usp.mesh"}, "usp.mesh": set()}
    assert _reaching(g, {"usp.mesh"})["usp.dims.a"] == ["usp.dims.a", "usp.dims.b", "usp.mesh"]


def test_parallel_dims_validate_once():
    dims = ParallelDims.for_world(8, ulysses=2, ring=2)
    assert (dims.dp, dims.sp, dims.world) == (2, 4, 8)
    assert ParallelDims.axis("fsdp") == ParallelDims.axis("loss") == "dp_sp"
    assert ParallelDims.axis("batch") == "dp" and ParallelDims.axis("sequence") == "sp"
    with pytest.raises(ValueError, match="does not divide world size 8"):
        ParallelDims.for_world(8, ulysses=3)
    with pytest.raises(ValueError, match="ring degree must be a positive integer, got 0"):
        ParallelDims(1, 0, 2)
    with pytest.raises(ValueError, match="placement must be one of"):
        ParallelDims(1, 2, 2, placement="ring_outer")
    with pytest.raises(ValueError, match="a2a_chunks=0 must be an integer >= 1 or auto"):
        ParallelDims(1, 2, 2, a2a_chunks=0)
    with pytest.raises(ValueError, match="fragment_bytes=-1 must be a positive number"):
        ParallelDims(1, 2, 2, fragment_bytes=-1)
    with pytest.raises(ValueError, match="unknown mesh role 'tensor'"):
        ParallelDims.axis("tensor")
