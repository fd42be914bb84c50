"""The ``arbiter`` command: one group, each command in a module of this package, imported only when it runs
(or when ``--help`` lists them), so a command a coding agent launches and waits for, such as ``arbiter mcp``,
loads what it needs and nothing else."""

from .group import main

__all__ = ["main"]
