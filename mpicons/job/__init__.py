"""The consolidation job: scan, distribute, write, check and publish, every phase agreed over the ranks.

Distributed scan and piece routing (``scan``), one rank's writing (``writer``) or writing with
bytes from other ranks (``exchange``), the replica check (``replicas``), progress and statistics,
and :func:`~mpicons.job.consolidation.consolidate` which runs them. It may import
:mod:`mpicons.core`, :mod:`mpicons.comm` and :mod:`mpicons.io`.
"""
