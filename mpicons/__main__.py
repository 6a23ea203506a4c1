"""``python -m mpicons``: the command line."""

from .cli import run

run()
