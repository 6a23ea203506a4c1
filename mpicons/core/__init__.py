"""The pure core: what a checkpoint is and what consolidating it means, as functions of their arguments.

Errors and reports, the file-name rules (``names``), the safetensors codec (``safetensors_codec``:
dtypes, header parsing and writing, which the plan computes offsets with), shard tables, dtype
conversion, the job's options, the plan (layout, work split, checks) and the geometry engine; also
the host facts every layer asks about (``machine``: memory, room to start, file-name limits).
Nothing here talks between ranks, starts MPI or imports torch or a storage library: it imports
only the standard library, numpy and ml_dtypes, and no other mpicons package.
"""
