"""Planner: choose ``dp x ring x ulysses`` from the model shape and the cluster.

Pure functions and dataclasses, no process group: ``plan()`` ranks the layouts a ``Search``
allows (its other inputs ``BatchSpec`` and ``StepPolicy``, in ``options``) with the cost
model in ``cost`` and answers a ``Plan`` (``ranking``), ``detect_topology()`` fills a ``ClusterSpec`` from the launcher and the
machine, ``draw_mesh()`` pictures a layout. ``cost.attention_cost`` is the model's
attention part; ``calibration`` sets it beside measured times, ``published`` beside
published benchmark figures. ``memory.memory_split`` is the per-rank memory model
(state, activations, attention, MLP, logits, peak) and ``max_seq_len`` its inverse.
"""

from ..config.cluster import ClusterSpec, load_cluster
from .cluster import GroupSpan, group_span, rank_grid
from .cost import AttentionCost, StepCost, attention_cost, estimate
from .detect import DetectReport, detect_topology
from .draw import MeshDrawing, draw_mesh
from .fit import max_seq_len
from .memory import CheckpointPolicy, MemorySplit, memory_split
from .options import BatchSpec, Search, StepPolicy
from .plan import plan
from .ranking import Candidate, Dropped, Plan

__all__ = [
    "AttentionCost",
    "BatchSpec",
    "Candidate",
    "CheckpointPolicy",
    "ClusterSpec",
    "DetectReport",
    "Dropped",
    "GroupSpan",
    "MemorySplit",
    "MeshDrawing",
    "Plan",
    "Search",
    "StepCost",
    "StepPolicy",
    "attention_cost",
    "detect_topology",
    "draw_mesh",
    "estimate",
    "group_span",
    "load_cluster",
    "max_seq_len",
    "memory_split",
    "plan",
    "rank_grid",
]
