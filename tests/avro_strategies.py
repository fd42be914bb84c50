"""Hypothesis strategies that build valid records straight from an Avro schema."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

LONG = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def for_type(avro: Any) -> st.SearchStrategy[Any]:
    """Values of one Avro type (the subset the contract uses)."""
    if isinstance(avro, list):
        return st.one_of(*[for_type(branch) for branch in avro])
    if isinstance(avro, dict):
        kind = avro["type"]
        if kind == "record":
            return for_record(avro)
        if kind == "array":
            return st.lists(for_type(avro["items"]), max_size=4)
        if kind == "map":
            return st.dictionaries(st.text(max_size=8), for_type(avro["values"]), max_size=4)
        return for_type(kind)
    return {
        "null": st.none(),
        "string": st.text(max_size=40),
        "long": LONG,
        "int": st.integers(min_value=-(2**31), max_value=2**31 - 1),
        "boolean": st.booleans(),
        "bytes": st.binary(max_size=64),
    }[avro]


def for_record(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts that fit a record schema."""
    return st.fixed_dictionaries({f["name"]: for_type(f["type"]) for f in schema["fields"]})
