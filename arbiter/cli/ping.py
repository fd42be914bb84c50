"""``arbiter ping``: round trips through the workers."""

from __future__ import annotations

import asyncio
import statistics

import click

from arbiter.agents.identities import ensure_identity
from arbiter.cli.terminal import fail, settings_of
from arbiter.schemas.identity import IdentityError


@click.command()
@click.option("--count", default=5, show_default=True, help="How many round trips.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for each answer.")
@click.pass_context
def ping(ctx: click.Context, count: int, timeout: float) -> None:
    """Round trips through the workers: a Ping command in, a Pong in the agent inbox out."""
    from arbiter.agents import ArbiterClient, ArbiterTimeout

    settings = settings_of(ctx)

    async def run() -> list[float]:
        rtts = []
        await ensure_identity(settings, "arbiter-cli")  # the operator's own probe identity (admin key: first use)
        async with ArbiterClient("arbiter-cli", settings) as client:
            for i in range(count):
                result = await client.ping(key=f"ping:{i}", timeout=timeout)
                rtts.append(result.rtt_ms)
                click.echo(f"pong from {result.worker_id} partition {result.partition}: {result.rtt_ms:.1f} ms")
        return rtts

    try:
        rtts = asyncio.run(run())
    except ArbiterTimeout as exc:
        fail(str(exc))
    except IdentityError as exc:
        fail(str(exc))
    if rtts:
        click.echo(f"{len(rtts)} round trips: median {statistics.median(rtts):.1f} ms, max {max(rtts):.1f} ms")
