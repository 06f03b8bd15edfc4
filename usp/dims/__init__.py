"""The pure layer: the run's parallel layout as data, decided before any process group.

No ``torch.distributed`` here, directly or through another module (``tests/unit/
test_pure_layer.py``): the planner prices these objects, the mesh, the layout, the ring and
the ulysses exchange run them, nobody re-derives them.

- ``parallel``: ``ParallelDims``, the degrees, placement, a2a stages and message
  fragments, with the mesh axes named by role (batch, sequence, loss, fsdp).
- ``placement``: where each global rank sits in the grid (``mesh_ranks``, ``node_order``).
- ``heads``: which heads each ulysses rank computes (``head_split``, ``check_heads``).
- ``counts``: near-equal parts of a count (``even_counts``) and its ``divisors``.
- ``tokens``: which global positions each rank holds (``Ownership``, ``segment_ranges``).
- ``stages``: the ulysses all-to-all's pipeline stages (``check_a2a_chunks``,
  ``default_a2a_chunks``, ``head_chunks``).
"""
