"""usp: hybrid Ulysses x Ring sequence parallelism for long-context training.

The names below load on first use, so that a command that needs no torch (``usp-prepare``
and its worker processes) does not pay for importing it.
"""

from importlib import import_module

_EXPORTS = {"usp_attention": ".attention", "CommStats": ".comm", "SequenceLayout": ".layout",
            "SPMesh": ".mesh", "ParallelDims": ".dims.parallel"}
__all__ = ["SPMesh", "SequenceLayout", "usp_attention", "CommStats", "ParallelDims"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
