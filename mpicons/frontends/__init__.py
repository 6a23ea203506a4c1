"""What users call beside the job itself: the command line, inspect, verify, the sample, the torch drop-in.

``cli`` (argument parsing, report files, the runner), ``inspection`` (``inspect()``),
``verification`` (``verify()``, with ``output_reading`` for what it reads), ``sample`` (the built-in
sample checkpoints, with ``_pickling`` for their ``.distcp`` form) and ``torch_dropin`` (torch's
consolidation function, done by mpicons). It may import every lower package: :mod:`mpicons.core`,
:mod:`mpicons.comm`, :mod:`mpicons.io`, :mod:`mpicons.job`.
"""
