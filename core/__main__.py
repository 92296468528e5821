"""``python -m dynaspec``."""

from dynaspec.cli import run

run()
