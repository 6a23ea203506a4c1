"""mpicons: MPI-parallel consolidation of sharded (DCP) safetensors checkpoints."""

__version__ = "0.1.0"

from .consolidation import ConsolidateResult, consolidate  # noqa: E402
from .errors import InputError, MpiconsError, WriteError  # noqa: E402

__all__ = ["consolidate", "ConsolidateResult", "MpiconsError", "InputError", "WriteError", "__version__"]
