"""faust's own ceiling: how fast one worker consumes messages when it does nothing with them.

Run by ``python -m bench ceiling`` as a child process (a faust worker owns its event
loop). It consumes ``N`` pre-produced messages from ``TOPIC`` and writes the rate to
``OUT``. Every figure the resource processor reaches is bounded by this one.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import faust

from arbiter.edge.settings import load_settings

from .faust import ArbiterApp, faust_settings


def main() -> None:
    topic_name, count, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    settings = load_settings(app_id=f"ceiling-{os.getpid()}")
    app = ArbiterApp(settings.app_id, **faust_settings(settings))
    app.arbiter_fetch_max_wait_ms = settings.fetch_max_wait_ms
    topic = app.topic(topic_name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    seen = {"n": 0, "t0": 0.0}

    @app.agent(topic)
    async def consume(stream: Any) -> None:
        async for _event in stream.events():
            if seen["n"] == 0:
                seen["t0"] = time.perf_counter()
            seen["n"] += 1
            if seen["n"] == count:
                rate = (count - 1) / (time.perf_counter() - seen["t0"])
                with open(out, "w") as fh:  # noqa: ASYNC230 - the last thing before exit
                    fh.write(f"{rate:.0f}\n")
                os._exit(0)

    faust.Worker(app, loglevel="error", quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main()
