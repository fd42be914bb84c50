"""The end of a chaos run: one table (the calm baseline beside the campaign when there is one), the
run's checks, and the issue's targets. Printed with ``rich`` when it is installed, as plain text if not."""

from __future__ import annotations

import sys
from typing import Any


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def phase_rows(phases: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(row name, one value per phase)."""
    def each(fmt: Any) -> list[str]:
        return [fmt(p) for p in phases]

    return [
        ("seconds", each(lambda p: f"{p['seconds']:.1f}")),
        ("operations attempted", each(lambda p: str(p["attempted"]))),
        ("succeeded", each(lambda p: f"{p['succeeded']} ({p['success_rate']:.1%})" if p["attempted"]
                           else "0")),
        ("succeeded per second", each(lambda p: f"{p['succeeded_per_s']:.1f}")),
        ("refused (by reason)", each(lambda p: ", ".join(f"{r} {n}" for r, n in p["refused"].items()) or "0")),
        ("timed out", each(lambda p: str(p["timed_out"]))),
        ("Kafka unreachable", each(lambda p: str(p["unavailable"]))),
        ("longest gap without a grant", each(lambda p: f"{p['longest_gap_s']:.2f} s")),
        ("acquire latency p50 / p99", each(lambda p: f"{_seconds(p['acquire_p50_s'])} / "
                                                    f"{_seconds(p['acquire_p99_s'])}")),
    ]


def lines(result: dict[str, Any]) -> list[str]:
    """The checks and targets below the table, as text."""
    out = []
    for check in result["checks"]:
        out.append(f"{'PASS' if check['ok'] else 'FAIL'}  {check['name']}: {check['detail']}")
    targets = result.get("targets")
    if targets:
        def met(ok: bool) -> str:
            return "met" if ok else "MISSED"

        share = targets["succeeded_per_s_share_of_calm"]
        rate = targets["success_rate_share_of_calm"]
        out.append(f"target: successful operations per second during the campaign >= {targets['share_target']:.0%} "
                   f"of calm: {'-' if share is None else f'{share:.0%}'} ({met(targets['share_met'])}; "
                   f"success rate {'-' if rate is None else f'{rate:.0%}'} of calm's)")
        out.append(f"target: acquire p99 <= {targets['p99_target_s']:g} s: {_seconds(targets['acquire_p99_s'])} "
                   f"({met(targets['p99_met'])})")
        out.append(f"target: zero audit violations: {targets['audit_violations']} ({met(targets['violations_met'])})")
    for finding in result["audit"]["findings"]:
        out.append(f"  audit: {finding}")
    topics = result["topics"]
    where = ("on a private broker, deleted with it" if topics["private_broker"] else
             "kept (--keep-topics)" if topics["kept"] else f"{topics['deleted']} topics deleted")
    out.append(f"topics: {topics['created']} created for the run, plus the workers' changelogs; {where}")
    out.append(f"log archive: {result['audit']['archive']}; audit report: {result['audit']['html']}")
    out.append(f"verdict: {'PASS' if result['ok'] else 'FAIL'}")
    return out


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The table's header and rows: the phases' figures, then the campaign's rows and the run's verdicts."""
    phases = result["phases"]
    header = ["", *[p["phase"] for p in phases]]
    rows = phase_rows(phases)
    blank = [""] * (len(phases) - 1)
    for name, value in result["campaign_rows"]:
        rows.append((name, [*(["-"] * len(blank)), value]))
    ledger = result["ledger"]
    rows.append(("ledger: lost / duplicated effects",
                 [*blank, f"{ledger['lost']} / {ledger['duplicated']} of {ledger['effects']} refunds"
                          + ("" if ledger["ok"] else " (BROKEN)")]))
    audit = result["audit"]
    rows.append(("audit verdict", [*blank, f"{audit['verdict'].upper()} ({audit['violations']} violations, "
                                           f"{audit['messages']} messages)"]))
    if blank:
        rows[-2] = (rows[-2][0], ["(one log: the whole run)", *rows[-2][1][1:]])
        rows[-1] = (rows[-1][0], ["(one log: the whole run)", *rows[-1][1][1:]])
    return header, rows


def plain(result: dict[str, Any]) -> str:
    """The table as plain text (for a JSON-less log or a test; the terminal gets rich's)."""
    header, rows = table_rows(result)
    widths = [max(len(r[0]) for r in rows)] + [max(len(header[i + 1]), *(len(r[1][i]) for r in rows))
                                             for i in range(len(header) - 1)]
    text = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    text.append("  ".join("-" * w for w in widths))
    for name, values in rows:
        text.append("  ".join(v.ljust(w) for v, w in zip([name, *values], widths, strict=True)).rstrip())
    return "\n".join(text)


def render(result: dict[str, Any], echo: Any) -> None:
    """Print the table (rich: it fits the terminal's width, or 140 columns in a pipe) and the lines below it."""
    o = result["options"]
    title = (f"arbiter chaos {result['campaign']}: {o['workers']} workers, {o['agents']} agents, "
             f"{o['partitions']} partitions, worker session timeout {o['session_timeout_s']:g} s"
             + (f" (asked {o['session_timeout_asked_s']:g} s; the broker's bounds)"
                if o.get("session_timeout_asked_s", o["session_timeout_s"]) != o["session_timeout_s"] else "")
             + f", broker {o.get('broker', '-')}, seed {o['seed']}")
    from rich import box
    from rich.console import Console
    from rich.table import Table

    header, rows = table_rows(result)
    echo(title)
    table = Table(box=box.SIMPLE_HEAD)
    for i, name in enumerate(header):
        table.add_column(name, overflow="fold", no_wrap=i == 0)
    for name, values in rows:
        table.add_row(name, *values)
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    for line in lines(result):
        echo(line)
