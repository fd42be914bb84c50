"""``arbiter audit``, ``arbiter replay`` and ``arbiter log``: the log, read back and judged."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import click

from arbiter.audit.log import Log, load_archive, read_log, write_archive
from arbiter.edge.kafkaconn import describe
from arbiter.edge.kafkaio import KafkaIOError
from arbiter.edge.settings import Settings

from .terminal import unreachable


def _fail(message: str, code: int = 2) -> NoReturn:
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(code)


def _writable(path: Path) -> Path:
    """``path``, once it is known that it can be written (before the long work that ends in writing it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            if path.is_dir() or not os.access(path, os.W_OK):
                raise PermissionError(13, "it is a directory" if path.is_dir() else "not writable")
        else:
            # Try the folder with a file of our own, so that nothing is left at ``path`` (an empty
            # checkpoint or report would look like a broken one) if the work fails.
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=True):
                pass
    except OSError as exc:
        _fail(f"cannot write {path}: {exc.strerror or exc}")
    return path


class _Bar:
    """A progress bar on stderr while the log is read (silent when stderr is not a terminal)."""

    def __init__(self, label: str, quiet: bool) -> None:
        self.label, self.quiet = label, quiet
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if self.bar is None:
            self.bar = click.progressbar(length=max(total, 1), label=self.label, file=sys.stderr,
                                         show_pos=True)
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.render_finish()


def load_log(settings: Settings, archive: Path | None, quiet: bool = False,
             since: dict[tuple[str, int], int] | None = None) -> Log:
    """The log from an archive, or read from the broker (from ``since``) with a progress bar."""
    if archive is not None:
        try:
            return load_archive(archive)
        except (OSError, ValueError) as exc:
            _fail(f"cannot read the archive: {exc}")
    bar = _Bar("reading the log", quiet)
    try:
        return asyncio.run(read_log(settings, bar, since=since))
    except (KafkaIOError, ConnectionError) as exc:
        unreachable(settings.bootstrap, describe(exc))
    except Exception as exc:
        _fail(f"cannot read the log at {settings.bootstrap}: {describe(exc)}")
    finally:
        bar.close()


def _settings_for(ctx: click.Context, log: Log | None = None) -> Settings:
    from .terminal import settings_of

    settings = settings_of(ctx)
    if log is not None:
        # An archive names the topics and the partition count it was recorded with.
        settings = settings.model_copy(update={"topics": log.topics,
                                               "partitions": log.partition_count or settings.partitions})
    return settings


_archive_option = click.option("--log", "archive", type=click.Path(path_type=Path, dir_okay=False, exists=True),
                               help="Audit an archive written by 'arbiter log export' instead of the live topics.")


@click.command()
@_archive_option
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON on stdout.")
@click.option("--html", "html_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Also write a self-contained HTML report (timeline, findings) to this file.")
@click.option("--partial", is_flag=True, help="The log was cut short (Ctrl-C): report unfinished sagas and "
              "requests as open items, not violations.")
@click.option("--strict", is_flag=True, help="Fail on an intrusion detected too (a forged or unauthorized message "
              "that no worker acted on), not only on a broken safety rule.")
@click.option("--checkpoint", "checkpoint_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Resume from this signed checkpoint if it exists (verified first), audit only what came after "
                   "it, and write the new checkpoint there (signed with the admin key).")
@click.pass_context
def audit(ctx: click.Context, archive: Path | None, as_json: bool, html_path: Path | None, partial: bool,
          strict: bool, checkpoint_path: Path | None) -> None:
    """Replay the whole log and check every safety rule. Exit 1 on a broken rule (or, with --strict, on an
    intrusion detected), 2 on bad input, 3 when Kafka cannot be reached; intrusions are reported either way."""
    from arbiter.audit import TrustAnchorsMissing, audit_from
    from arbiter.audit.checkpoint import Checkpoint, CheckpointError

    if html_path is not None:
        _writable(html_path)
    settings = _settings_for(ctx)
    resume: Checkpoint | None = None
    admin = None
    if checkpoint_path is not None:
        from arbiter.agents.identities import admin_signer
        from arbiter.audit.replay import trust_anchors
        from arbiter.schemas.identity import IdentityError

        _writable(checkpoint_path)
        try:
            admin = admin_signer(settings.home, create=False)
        except IdentityError as exc:
            _fail(f"--checkpoint signs what it writes with the admin key: {exc}")
        if checkpoint_path.exists():
            try:
                resume = Checkpoint.read(checkpoint_path)
                resume.verify(trust_anchors(settings))
                resume.check_settings(settings)
            except (CheckpointError, TrustAnchorsMissing) as exc:
                _fail(f"{checkpoint_path}: {exc}")
    since = resume.since(settings.topics.registry) if resume is not None and archive is None else None
    log = load_log(settings, archive, quiet=as_json, since=since)
    settings = _settings_for(ctx, log)
    if resume is not None:
        try:
            log, _slice = resume.continue_with(log, settings)
        except CheckpointError as exc:
            _fail(f"{checkpoint_path}: {exc}")
    try:
        report, done = asyncio.run(audit_from(log, settings, resume, complete=not partial, strict=strict,
                                              checkpointing=checkpoint_path is not None))
    except TrustAnchorsMissing as exc:
        _fail(str(exc))
    if checkpoint_path is not None and admin is not None:
        made = done.checkpoint(settings, admin)
        made.write(checkpoint_path)
        report.setdefault("checkpoint", {})["written"] = {"path": str(checkpoint_path),
                                                          "slice_messages": len(made.slice_lines)}
    if html_path is not None:
        from arbiter.audit.html import render

        html_path.write_text(render(report), encoding="utf-8")
    if as_json:
        click.echo(json.dumps(report, sort_keys=True))
    else:
        print_summary(report, html_path)
    sys.exit(0 if report["verdict"] == "pass" else 1)


def verdict_line(report: dict[str, Any]) -> str:
    """The one-line verdict every view of a report shows (terminal, demo, HTML page)."""
    intrusions = report.get("intrusions", 0)
    seen = (f"; {intrusions} intrusion(s) detected, refused or ignored, nothing changed by them" if intrusions
            else "")
    if report["verdict"] == "pass":
        return "PASS: no safety rule was broken" + seen
    if not report.get("violations"):
        return f"FAIL (--strict): {intrusions} intrusion(s) detected; no safety rule was broken"
    return f"FAIL: {report['violations']} safety rule violation(s)" + seen


def print_summary(report: dict[str, Any], html_path: Path | None = None, limit: int = 20) -> None:
    """The terminal summary of an audit report."""
    stats = report["stats"]
    start, end = report["span_ms"]
    click.echo(f"audit of {report['source']}: {report['messages']} messages over {(end - start) / 1000:.1f} s")
    checkpoint = report.get("checkpoint") or {}
    if checkpoint.get("resumed"):
        click.echo(f"  resumed from a checkpoint of {checkpoint['messages_before']} messages: audited the "
                   f"{checkpoint['new_messages']} after it, with the {checkpoint['slice_messages']} still live")
    if checkpoint.get("written"):
        click.echo(f"  checkpoint written to {checkpoint['written']['path']} "
                   f"({checkpoint['written']['slice_messages']} messages kept live)")
    click.echo(f"  replayed {stats.get('inputs', 0)} inputs into {stats.get('decisions', 0)} decisions "
               f"in {report['timing']['replay_s']:.2f} s; {stats.get('redelivered', 0)} redelivered copies")
    click.echo(f"  grants {stats.get('grants', 0)}, writes applied {stats.get('writes', 0)}, rejected "
               f"{stats.get('rejected_writes', 0)}, expiries {stats.get('expiries', 0)}, deadlocks "
               f"{stats.get('deadlocks', 0)}, sagas {stats.get('sagas', 0)} "
               f"({stats.get('sagas_compensated', 0)} compensated)")
    if "signatures_verified" in stats:
        click.echo(f"  signatures verified {stats['signatures_verified']}, commands refused by the workers "
                   f"{stats.get('refused_commands', 0)}, registry records {stats.get('registry_records', 0)}")
    elif report.get("signatures"):
        click.echo(f"  signatures {report['signatures']}")
    actions = report.get("human_actions") or []
    if actions:
        click.echo(f"  human actions (operator overrides): {len(actions)}")
        for action in actions[:limit]:
            click.echo(f"    {action['who']}: {action['what']}, because {action['reason']!r} at {action['where']}")
    _checks_table(report["checks"])
    findings = report["findings"]
    for finding in findings[:limit]:
        colour = {"violation": "red", "intrusion": "magenta"}.get(finding["severity"], "yellow")
        click.secho(f"  {finding['severity']}: [{finding['check']}] {finding['message']}", fg=colour)
        click.echo(f"      at {', '.join(finding['where']) or 'end of log'}")
    if len(findings) > limit:
        click.echo(f"  ... and {len(findings) - limit} more (see --json or --html)")
    click.secho("verdict: " + verdict_line(report), fg="green" if report["verdict"] == "pass" else "red", bold=True)
    if html_path is not None:
        click.echo(f"report: {html_path.resolve()}")


@click.command()
@_archive_option
@click.option("--at", "at", help="State at a moment: ISO time, epoch ms, +<seconds>s after the log's start, or "
              "topic[partition]@offset.")
@click.option("--policy", help="What-if: re-run the agents' commands under other rules, e.g. ttl=30s,victim=youngest "
              "(victim: priority | youngest | oldest).")
@click.pass_context
def replay(ctx: click.Context, archive: Path | None, at: str | None, policy: str | None) -> None:
    """Time travel (--at) and what-if (--policy) over the recorded log. Prints JSON."""
    from arbiter.audit.replay import Moment, Policy, TrustAnchorsMissing, parse_moment, state_at

    if (at is None) == (policy is None):
        _fail("give exactly one of --at or --policy")
    parsed_policy: Policy | None = None
    if policy is not None:
        try:
            parsed_policy = Policy.parse(policy)
        except ValueError as exc:
            _fail(str(exc))
    settings = _settings_for(ctx)
    log = load_log(settings, archive, quiet=True)
    settings = _settings_for(ctx, log)
    if at is not None:
        try:
            moment: Moment = parse_moment(at, log)
        except ValueError as exc:
            _fail(str(exc))
        try:
            state = asyncio.run(state_at(log, settings, moment))
        except TrustAnchorsMissing as exc:
            _fail(str(exc))
        click.echo(json.dumps(state, sort_keys=True, indent=2))
        return
    assert parsed_policy is not None
    from arbiter.audit.whatif import compare

    try:
        compared = asyncio.run(compare(log, settings, parsed_policy))
    except TrustAnchorsMissing as exc:
        _fail(str(exc))
    click.echo(json.dumps(compared, sort_keys=True, indent=2))


@click.group("log")
def log_group() -> None:
    """Export Arbiter's log to a portable archive (audit it later, anywhere, with --log)."""


@log_group.command("export")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.pass_context
def log_export(ctx: click.Context, path: Path) -> None:
    """Write every message of every Arbiter topic to PATH, one JSON object per line."""
    _writable(path)
    settings = _settings_for(ctx)
    log = load_log(settings, None)
    count = write_archive(path, log)
    click.echo(f"wrote {count} messages to {path}")


COMMANDS = (audit, replay, log_group)


def _checks_table(checks: dict[str, Any]) -> None:
    """One row per safety rule (rich: fitted to the terminal, plain text in a pipe or a log)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1))
    for column in ("mark", "check", "rule", "found"):
        table.add_column(column, no_wrap=column in ("mark", "check"), overflow="fold")
    for name, row in checks.items():
        ok = row["violations"] == 0
        found = "  ".join(x for x in (f"{row['violations']} violation(s)" if row["violations"] else "",
                                      f"{row.get('intrusions', 0)} intrusion(s) detected" if row.get("intrusions")
                                      else "", f"({row['open']} open)" if row["open"] else "") if x)
        table.add_row(Text("ok" if ok else "FAIL", style="green" if ok else "bold red"), Text(name),
                      Text(str(row["description"])), Text(found))
    console = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    with console.capture() as captured:
        console.print(table)
    click.echo("\n".join("  " + line.rstrip() for line in captured.get().splitlines()), color=console.is_terminal)
