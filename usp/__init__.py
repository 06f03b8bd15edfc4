"""usp: hybrid Ulysses x Ring sequence parallelism for long-context training."""

from .attention import usp_attention
from .comm import CommStats
from .layout import SequenceLayout
from .mesh import SPMesh

__all__ = ["SPMesh", "SequenceLayout", "usp_attention", "CommStats"]
__version__ = "0.1.0"
