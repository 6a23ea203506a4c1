"""The pure core: what a checkpoint is and what consolidating it means, as functions of their arguments.

Errors and reports, the file-name rules (``names``), the safetensors format, shard tables and DCP
metadata, dtype conversion, the job's options, the plan (layout, work split, checks), the geometry
engine and the checks of a consolidated checkpoint (``checkpoint_checks``); also the host facts
every layer asks about (``machine``: memory, room to start, file-name limits). Nothing here talks
between ranks, starts MPI or imports torch or a storage library: it imports only the standard
library, numpy and ml_dtypes, and no other mpicons package.
"""
