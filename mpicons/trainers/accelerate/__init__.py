"""accelerate's FSDP checkpoints: recognising a ``SHARDED_STATE_DICT`` save (a DCP directory whose
tensor names carry accelerate's ``model.`` prefix) so that it consolidates without options
(:mod:`.fsdp`, pure). Imports only :mod:`mpicons.core`."""
