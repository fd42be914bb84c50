"""The ``arbiter chaos`` command: its options, checked, and one run of ``runner.run_chaos``, printed."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click

from .campaigns import CAMPAIGNS, DEFAULT_EVERY, SHORT, SHORT_EVERY

DEFAULT_DURATION = 60.0


@click.command()
@click.argument("campaign", type=click.Choice(list(CAMPAIGNS)))
@click.option("--duration", type=float, default=None,
              help=f"Seconds the campaign runs (default {DEFAULT_DURATION:g}; with --short, a few).")
@click.option("--every", type=float, default=None,
              help="Seconds between faults (worker-kill 5, broker-restart 10 after the broker is back, "
                   "duplicates and malformed 2; freeze-agent's cycles follow each other).")
@click.option("--workers", default=3, show_default=True, help="Worker processes (the pool keeps this size).")
@click.option("--agents", default=8, show_default=True, help="Honest agents acquiring, writing and releasing.")
@click.option("--seed", default=7, show_default=True, help="Seed of the agents' and the campaign's choices.")
@click.option("--calm", "with_calm", is_flag=True,
              help="First run the same workload without faults for as long, on the same setup; print both "
                   "side by side with the targets.")
@click.option("--short", is_flag=True, help="A few seconds, a fault or two: for CI.")
@click.option("--ttl", "freeze_ttl", default=2.0, show_default=True,
              help="freeze-agent: the frozen agent's lease TTL in seconds.")
@click.option("--broker-home", type=click.Path(path_type=Path, file_okay=False),
              help="broker-restart: kill and restart the local broker of this home (its port: --kafka-port), "
                   "started there if it is not running. Default: a private broker in a temporary home, on free "
                   "ports, so a shared broker is never killed.")
@click.option("--private-broker", is_flag=True,
              help="Run on a private broker started for the run (a temporary home, free ports), whatever the "
                   "campaign: its settings are this Arbiter's own. broker-restart always has one (or --broker-home).")
@click.option("--keep-topics", is_flag=True, help="Keep the run's topics (default: deleted once the log is "
                                                  "archived in the run's folder).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON instead of the table.")
@click.pass_context
def chaos(ctx: click.Context, campaign: str, duration: float | None, every: float | None, workers: int,
          agents: int, seed: int, with_calm: bool, short: bool, freeze_ttl: float, broker_home: Path | None,
          private_broker: bool, keep_topics: bool, as_json: bool) -> None:
    """Run a fault campaign against a live Arbiter it starts itself; audit the run and print a table."""
    from aiokafka.errors import KafkaError

    from arbiter.cli.terminal import EXIT_UNAVAILABLE, fail, say, settings_of
    from arbiter.edge.kafkaconn import describe
    from arbiter.edge.kafkaio import KafkaIOError

    from .report import render
    from .runner import ChaosOptions, run_chaos

    if workers < 1 or agents < 1 or freeze_ttl <= 0:
        fail("--workers and --agents must be at least 1, --ttl above 0")
    if campaign == "worker-kill" and workers < 2:
        fail("worker-kill needs at least 2 workers (one survives each kill)")
    if broker_home is not None and campaign != "broker-restart":
        fail("--broker-home is for the broker-restart campaign only")
    seconds = duration if duration is not None else SHORT[campaign] if short else DEFAULT_DURATION
    pause = every if every is not None else SHORT_EVERY.get(campaign, DEFAULT_EVERY[campaign]) if short \
        else DEFAULT_EVERY[campaign]
    if seconds <= 0 or (pause <= 0 and campaign not in ("calm", "freeze-agent")):
        fail("--duration and --every must be above 0")
    options = ChaosOptions(campaign, seconds, pause, workers, agents, seed, calm=with_calm and campaign != "calm",
                           freeze_ttl=freeze_ttl, keep_topics=keep_topics, broker_home=broker_home,
                           private_broker=private_broker)
    settings = settings_of(ctx)
    # The Kafka clients' own complaints (a broker gone, a leader moving) are what a campaign causes on
    # purpose: the table reports their effect.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    configured = bool((ctx.find_root().obj or {}).get("bootstrap"))

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # A closed terminal or a kill stops the run like Ctrl-C does: what it started stops too.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        result = asyncio.run(run_chaos(settings, options, configured, say))
    except KeyboardInterrupt:
        say("\ninterrupted; everything the run started is stopped")
        sys.exit(130)
    except (KafkaError, KafkaIOError, ConnectionError) as exc:
        fail(f"chaos {campaign} could not reach Kafka at {settings.bootstrap}: {describe(exc)}",
             "is it up? 'arbiter kafka status' says; 'arbiter kafka up' starts the local one", code=EXIT_UNAVAILABLE)
    except Exception as exc:
        fail(f"chaos {campaign} failed: {describe(exc)}")
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
    else:
        render(result, click.echo)
    sys.exit(0 if result["ok"] else 1)
