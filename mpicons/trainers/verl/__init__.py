"""verl FSDP actor checkpoints (FSDP2, and FSDP1 saved with a device mesh): which files an ``actor/``
directory holds (:mod:`.files`), what each rank's ``torch.save`` archive says (:mod:`.records`, read
without torch), and where every row of every parameter lies (:mod:`.layout`, pure). Imports only
:mod:`mpicons.core`. The facts are in docs/torch-archive-format.md."""
