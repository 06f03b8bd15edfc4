"""Pictures of a ``dp x ring x ulysses`` layout: which rank sits on which node, and which
ulysses (all-to-all) and ring (P2P) group it belongs to.

Ranks are node-major (node n holds ranks n*K .. n*K+K-1); the mesh is the one
``usp.dims.placement.mesh_ranks`` builds: ``arange(world).reshape(dp, ring, ulysses)`` for
``ulysses_inner``, ``arange(world).reshape(dp, ulysses, ring).transpose(1, 2)`` for
``ring_inner``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cluster import rank_grid


@dataclass
class MeshDrawing:
    """A layout to draw. ``coords[rank] = (dp, ring, ulysses)`` mesh coordinate."""

    dp: int
    ring: int
    ulysses: int
    ranks_per_node: int
    placement: str = "ulysses_inner"
    max_nodes: int = 8  # nodes shown in text; the rest are summarised

    def __post_init__(self) -> None:
        grid = rank_grid(self.dp, self.ring, self.ulysses, self.ranks_per_node, self.placement)
        self.world = self.dp * self.ring * self.ulysses
        self.coords: dict[int, tuple[int, int, int]] = {
            grid[d][i][j]: (d, i, j)
            for d in range(self.dp) for i in range(self.ring) for j in range(self.ulysses)
        }
        # group id of every rank on each axis, numbered in mesh order
        self.ulysses_group = {k: d * self.ring + i for k, (d, i, j) in self.coords.items()}
        self.ring_group = {k: d * self.ulysses + j for k, (d, i, j) in self.coords.items()}
        self.ulysses_groups = [row for plane in grid for row in plane]  # [dp*ring][ulysses]
        self.ring_groups = [  # [dp*ulysses][ring], in ring order
            [plane[i][j] for i in range(self.ring)] for plane in grid for j in range(self.ulysses)
        ]

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def nodes(self) -> int:
        return max(1, -(-self.world // self.ranks_per_node))

    def _nodes_of(self, group: list[int]) -> str:
        ns = sorted({self.node(r) for r in group})
        if len(ns) == 1:
            return f"node {ns[0]}"
        return f"nodes {ns}" if len(ns) <= 8 else f"{len(ns)} nodes {ns[0]}..{ns[-1]}"

    def text(self) -> str:
        """Per node: each rank as ``rank:U<ulysses group>/R<ring group>``; then the groups."""
        K = self.ranks_per_node
        w = len(str(self.world - 1))
        uw, rw = len(str(self.dp * self.ring - 1)), len(str(self.dp * self.ulysses - 1))
        lines = [
            f"dp {self.dp} x ring {self.ring} x ulysses {self.ulysses} = {self.world} ranks "
            f"on {self.nodes} node(s) of {K} ({self.placement}); "
            f"cell = rank:U<ulysses group>/R<ring group>"
        ]
        for n in range(min(self.nodes, self.max_nodes)):
            cells = [
                f"{r:>{w}}:U{self.ulysses_group[r]:0{uw}}/R{self.ring_group[r]:0{rw}}"
                for r in range(n * K, min((n + 1) * K, self.world))
            ]
            lines.append(f"node {n}: " + "  ".join(cells))
        if self.nodes > self.max_nodes:
            lines.append(f"... {self.nodes - self.max_nodes} more nodes")
        if self.ulysses > 1:
            g = self.ulysses_groups[0]
            cross = sum(1 for grp in self.ulysses_groups if len({self.node(r) for r in grp}) > 1)
            lines.append(
                f"ulysses groups (all-to-all): {len(self.ulysses_groups)} x {self.ulysses} ranks, "
                f"U0 = {g} on {self._nodes_of(g)}"
                + (f"; {cross} span nodes (all-to-all over the inter-node link)" if cross else "")
            )
        if self.ring > 1:
            g = self.ring_groups[0]
            hops = sum(self.node(g[i]) != self.node(g[(i + 1) % len(g)]) for i in range(len(g)))
            lines.append(
                f"ring groups (P2P): {len(self.ring_groups)} x {self.ring} ranks, "
                f"R0 = {' -> '.join(map(str, g + g[:1]))} on {self._nodes_of(g)}, "
                f"{hops} of {len(g)} hops cross nodes"
            )
        if self.dp > 1:
            g = [self.ulysses_groups[d * self.ring][0] for d in range(self.dp)]
            lines.append(f"dp groups: {self.ring * self.ulysses} x {self.dp} ranks, e.g. {g}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def save_png(self, path: str | Path) -> Path:
        """Draw nodes as rows of GPU boxes, coloured by ulysses group, labelled with the
        ring group; ring group R0 drawn as arrows. Uses matplotlib's Agg backend."""
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyArrowPatch, Rectangle

        K, nodes = self.ranks_per_node, self.nodes
        fig = Figure(figsize=(1.0 + 1.1 * K, 0.8 + 1.0 * nodes))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        cmap = matplotlib.colormaps["tab20"]
        center = {}
        for r in range(self.world):
            n, k = divmod(r, K)
            x, y = k * 1.1, -n * 1.0
            center[r] = (x + 0.5, y + 0.4)
            color = cmap(self.ulysses_group[r] % 20)
            ax.add_patch(Rectangle((x, y), 1.0, 0.8, facecolor=color, edgecolor="black"))
            ax.text(x + 0.5, y + 0.4, f"{r}\nU{self.ulysses_group[r]} R{self.ring_group[r]}",
                    ha="center", va="center", fontsize=7)
        for n in range(nodes):
            ax.text(-0.15, -n * 1.0 + 0.4, f"node {n}", ha="right", va="center", fontsize=8)
        g = self.ring_groups[0]
        for i in range(len(g) if self.ring > 1 else 0):
            a, b = center[g[i]], center[g[(i + 1) % len(g)]]
            arrow = FancyArrowPatch(a, b, arrowstyle="->", mutation_scale=10, shrinkA=14,
                                    shrinkB=14, connectionstyle="arc3,rad=0.25", color="black")
            ax.add_patch(arrow)
        ax.set_xlim(-1.0, K * 1.1)
        ax.set_ylim(-(nodes - 1) * 1.0 - 0.2, 1.0)
        ax.set_axis_off()
        ax.set_title(f"dp {self.dp} x ring {self.ring} x ulysses {self.ulysses} "
                     f"({self.placement}); colour = ulysses group, arrows = ring R0", fontsize=9)
        path = Path(path)
        fig.savefig(path, dpi=100)
        return path


def draw_mesh(
    dp: int, ring: int, ulysses: int, ranks_per_node: int, placement: str = "ulysses_inner"
) -> MeshDrawing:
    """The layout as a ``MeshDrawing``: ``str()`` it for text, ``.save_png(path)`` for a picture."""
    return MeshDrawing(dp, ring, ulysses, ranks_per_node, placement)
