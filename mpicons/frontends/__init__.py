"""What users call beside the job itself: the command line, inspect, verify, the sample, the torch drop-in.

``cli`` (argument parsing, report files, the runner), ``inspection`` (``inspect()``),
``verification`` (``verify()``, with ``output_reading`` for what it reads, ``verify_checks`` for
what it checks and ``manifest_check`` for ``SHA256SUMS``), ``sample`` (the built-in sample
checkpoints) and ``torch_dropin`` (torch's consolidation function, done by mpicons). It may import
every lower package.
"""
