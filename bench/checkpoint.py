"""Audit from a checkpoint: its cost follows what came after the checkpoint, not the history.

``python -m bench checkpoint [--messages 200000] [--after 5000,20000,50000]``

One log is generated the way ``bench.replay`` makes its (the processors' own code decides a workload of
agents' commands and the worker's ticks; rounds 50 ms apart, the workers' id window 5 s, so the log
spans several minutes and the checkpoint's horizon, twice the id window, a small part of it). Its
first ``--messages`` are audited whole (a log still being written: its unfinished work is open, not
failed) and leave a signed checkpoint; then, for each ``--after`` count,
the audit resumes from that checkpoint over the messages that followed, and, beside it in the same run,
an audit of the whole log up to the same point starts from zero. Both must judge alike (verdict,
findings, figures); the figures are seconds and new messages per second.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from arbiter.audit import audit_from
from arbiter.audit.checkpoint import Checkpoint
from arbiter.audit.log import Log
from arbiter.audit.replay import simulate
from arbiter.edge.settings import Settings
from arbiter.schemas.identity import Signer

from .replay import ROUND_MESSAGES, workload

SPACING_MS = 50
ID_WINDOW_MS = 5_000


def _first(log: Log, count: int) -> Log:
    """The log as it stood when it held ``count`` messages (every partition up to one moment)."""
    moments = sorted(e.timestamp_ms for e in log.entries())
    moment = moments[min(count, len(moments)) - 1]
    out = Log(log.topics, source=log.source, partition_count=log.partition_count)
    for entries in log.partitions.values():
        for entry in entries:
            if entry.timestamp_ms > moment:
                break
            out.add(entry)
    return out


def _judged(report: dict[str, Any]) -> tuple[Any, ...]:
    keys = ("grants", "writes", "rejected_writes", "expiries", "acquires", "intents", "decisions")
    return (report["verdict"], len(report["findings"]), report["messages"],
            tuple(report["stats"].get(k, 0) for k in keys))


async def run(messages: int, after: list[int]) -> None:
    settings = Settings(partitions=4, id_window_ms=ID_WINDOW_MS,
                        admin_public_keys="")  # (the checkpoint's key is given below)
    admin = Signer.generate("admin")
    total = messages + max(after)
    started = time.perf_counter()
    log = await simulate(Log(settings.topics, source="bench", partition_count=settings.partitions), settings,
                         outside=workload(settings, total // ROUND_MESSAGES + 1, spacing_ms=SPACING_MS))
    span = log.span_ms()
    print(f"checkpoint: generated a log of {len(log):,} messages over {(span[1] - span[0]) / 1000:.0f} s in "
          f"{time.perf_counter() - started:.1f} s (id window {ID_WINDOW_MS / 1000:g} s: the checkpoint keeps "
          f"the last {2 * ID_WINDOW_MS / 1000:g} s and what is still live)")
    base = _first(log, messages)
    started = time.perf_counter()
    first, done = await audit_from(base, settings, complete=False, checkpointing=True)
    audited = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "audit.checkpoint"
        started = time.perf_counter()
        done.checkpoint(settings, admin).write(path)
        wrote = time.perf_counter() - started
        size = path.stat().st_size
        kept = len(Checkpoint.read(path).slice_lines)
        print(f"checkpoint: audit of the first {len(base):,} messages {audited:.2f} s, verdict {first['verdict']}; "
              f"checkpoint written in {wrote:.2f} s: {size / 1e6:.1f} MB, {kept:,} messages kept live "
              f"({100 * kept / len(base):.1f}% of the log)")
        for count in after:
            upto = _first(log, len(base) + count)
            new = len(upto) - len(base)
            started = time.perf_counter()
            checkpoint = Checkpoint.read(path)
            checkpoint.verify([admin.public_raw])
            checkpoint.check_settings(settings)
            resumed_log, _slice = checkpoint.continue_with(upto, settings)
            resumed, _ = await audit_from(resumed_log, settings, checkpoint, complete=False)
            from_checkpoint = time.perf_counter() - started
            started = time.perf_counter()
            whole, _ = await audit_from(upto, settings, complete=False)
            from_zero = time.perf_counter() - started
            same = _judged(resumed) == _judged(whole)
            print(f"checkpoint: +{new:>7,} new messages: from the checkpoint {from_checkpoint:6.2f} s "
                  f"({new / from_checkpoint:>8,.0f} new messages/s); the whole {len(upto):,} from zero "
                  f"{from_zero:6.2f} s; same judgement: {'yes' if same else 'NO'}")
            if not same:
                raise SystemExit(f"a resumed audit judged differently: {_judged(resumed)} != {_judged(whole)}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench checkpoint")
    parser.add_argument("--messages", type=int, default=200_000, help="messages audited whole first")
    parser.add_argument("--after", default="5000,20000,50000", help="new messages to audit from the checkpoint")
    args = parser.parse_args(argv)
    asyncio.run(run(args.messages, [int(n) for n in args.after.split(",")]))
