"""Benchmarks: commands that print figures. Run with ``./dev bench`` (see docs/benchmarks.md)."""
