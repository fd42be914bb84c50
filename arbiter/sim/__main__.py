"""``python -m arbiter.sim [--seeds N] [--seed S] [--scenario NAME]`` (``./dev sim``): run seeded scenarios.

Prints how many ran and how fast, and each failing seed with what the checker found and the one
command that replays it. Exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from .scenarios import SCENARIOS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev sim", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds, from --first (default 100)")
    parser.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--seed", type=int, help="run this one seed (a replay)")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help="this scenario only (default: all)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    names = [args.scenario] if args.scenario else sorted(SCENARIOS)
    seeds = [args.seed] if args.seed is not None else list(range(args.first, args.first + args.seeds))
    started, runs, failed = time.monotonic(), 0, 0
    for name in names:
        for seed in seeds:
            outcome = SCENARIOS[name](seed)
            runs += 1
            if outcome.findings:
                failed += 1
                print(f"FAIL {name} seed {seed}: {len(outcome.findings)} findings; replay: "
                      f"./dev sim --scenario {name} --seed {seed}")
                for finding in outcome.findings[:5]:
                    print(f"    {finding}")
            elif args.seed is not None:
                print(f"ok {name} seed {seed}: {outcome.decisions} decisions, the audit passes")
            if runs % 10 == 0:
                print(f"... {runs} run, {failed} failed", file=sys.stderr)
    elapsed = time.monotonic() - started
    print(f"{runs} scenarios in {elapsed:.1f} s ({60 * runs / elapsed:.0f} a minute on one core), {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
