"""``python -m arbiter``: the same as the ``arbiter`` command."""

from .cli import main

main()
