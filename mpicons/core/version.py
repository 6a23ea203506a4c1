"""mpicons' version, in the lowest layer so that every layer (the command line's ``--version`` too) may read it."""

__version__ = "0.2.0"
