"""The house: usp's modules import only from layers below them (imports inside functions
and under ``TYPE_CHECKING`` included), so there is no import loop; the installed package
never imports the lab (``tools``) and holds nothing that needs DeepSpeed, namespaces or tc.
The layers are those of the design notes, bottom first."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "usp"

# usp.<first name> (or usp.<package>.<module>, which then takes that one module out of its
# package's layer) -> layer, bottom first; a module imports from its own layer or below
LAYERS = (
    ("compat",),
    ("rules", "config"),
    ("dims",),  # the pure layer: no torch.distributed (test_pure_layer.py)
    ("comm",),
    ("kernels",),
    ("mesh_exit",),
    ("mesh", "layout"),
    ("masks",),
    ("ring", "ulysses", "ring_flash", "pipelined"),
    ("attention",),
    ("models", "data"),
    ("planner",),
    # evaluation (usp-eval and the trainer's): passkey cases and scoring, loss by position,
    # validation loss, the sharded forward, the outputs; the run's checks read its grid
    ("eval",),
    ("run",),
    ("slurm", "launch"),
    ("eval.runner", "eval.command"),  # usp-eval's command: its layout from usp.run
    ("train",),
    ("hydra_app", "cli", "bench"),  # hydra_app: only the CLI touches Hydra
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """``usp.a.b`` -> its file, packages by their ``__init__.py``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``name`` imports (anywhere in the file), resolved to the longest
    known module name; the packages a submodule import runs are added as well."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: None if is_pkg else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            parts = t.split(".")
            while parts and ".".join(parts) not in known and parts[0] != "tools":
                parts.pop()
            if parts:
                found.add(".".join(parts))
    # importing usp.a.b runs usp.a's __init__ first (usp's own is the root: skip it)
    for t in list(found):
        parts = t.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if parent in known and not name.startswith(parent + ".") and parent != name:
                found.add(parent)
    # its own packages are running already (``from .. import compat`` imports compat only)
    return {t for t in found if t != name and not name.startswith(t + ".")}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYER.get(".".join(parts[1:3]), LAYER.get(parts[1])) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    missing = sorted(n for n in modules() if n != "usp" and layer(n) is None)
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_no_import_goes_up_a_layer_and_no_loop():
    g = graph()
    up = sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts
                if t.startswith("usp.") and layer(m) is not None and layer(t) is not None
                and layer(t) > layer(m))
    assert not up, "imports from a layer above:\n" + "\n".join(up)
    assert cycles(g) == []


def test_the_checker_sees_loops_and_function_level_imports(tmp_path):
    """The graph above must be able to fail: a loop through an import inside a function."""
    pkg = tmp_path / "usp"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text(
        "def local():\n    from ..ring import plan\n")
    (pkg / "ring.py").write_text("from .kernels import local\n")
    known = modules(pkg)
    g = {n: imports(n, p, known) for n, p in known.items()}
    assert g["usp.kernels"] == {"usp.ring"}
    assert cycles(g) == [["usp.kernels", "usp.ring"]]


def test_the_package_never_imports_the_lab():
    g = graph()
    lab = sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts if t.split(".")[0] == "tools")
    assert not lab, lab
    text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    for needs in ("import deepspeed", "from deepspeed", "ip netns", "unshare", "tc qdisc"):
        assert needs not in text, f"usp/ holds lab code: {needs!r}"


def test_nothing_in_the_package_imports_the_cli():
    """One path, read forward: the console script (``usp.cli``) parses and hands over; no
    module below it imports it, so none can call back into it (``usp.hydra_app`` beside it
    included)."""
    g = graph()
    callers = sorted(m for m, ts in g.items() if "usp.cli" in ts and m != "usp.cli")
    assert not callers, f"modules importing usp.cli: {callers}"
    text = {p: p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "cli.py"}
    named = sorted(str(p.relative_to(ROOT)) for p, t in text.items()
                   if any(s in t for s in ("from .cli", "from ..cli", "import usp.cli",
                                           "from usp.cli", "from usp import cli")))
    assert not named, f"usp/ sources naming usp.cli in an import: {named}"
