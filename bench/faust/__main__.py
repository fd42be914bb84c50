"""``python -m bench.faust [--loglevel LEVEL]``: one worker on the faust runtime (the benchmarks' baseline)."""

from __future__ import annotations

import sys

import faust

from arbiter.cli.identity import ensure_worker_identity
from arbiter.edge.settings import load_settings

from . import faust_app


def main() -> None:
    loglevel = sys.argv[sys.argv.index("--loglevel") + 1] if "--loglevel" in sys.argv else "warning"
    settings = load_settings()
    ensure_worker_identity(settings)
    faust.Worker(faust_app(settings), loglevel=loglevel, quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main()
