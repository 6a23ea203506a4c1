"""DeepSpeed ZeRO checkpoints (stage 1, 2 and 3): which files a ``global_stepN/`` directory holds
(:mod:`.files`), what their ``torch.save`` archives say (:mod:`.records`, read without torch or
DeepSpeed), and where every element of every fp32 master weight lies (:mod:`.layout`, pure).
Imports only :mod:`mpicons.core`. The facts are in docs/torch-archive-format.md."""
