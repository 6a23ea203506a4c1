"""Files: reading shards, writing outputs and publishing the output directory.

Shard reads (``sources``), output backends (``outputs``: POSIX; ``mpiio``: MPI-IO), the output
directory (``outdir``: its ``lock``, the ``journal``ed publish and recovery; ``regular_files``: opening
only regular files, bounded), the output formats (``output_formats``,
with ``hdf5``'s h5py layout) and object storage (``s3`` and its neighbours, the multipart plan in
``s3_upload_plan``). It may import :mod:`mpicons.core`, :mod:`mpicons.formats` (byte views, shard
headers) and :mod:`mpicons.comm` (the communicator type, the signal deferral); only ``mpiio``
imports mpi4py.
"""
