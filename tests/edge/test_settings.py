"""Settings come from one ARBITER_ prefix, with clear errors on bad values."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from arbiter.edge.settings import Settings, load_settings


def test_defaults_point_at_the_local_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("ARBITER_BOOTSTRAP", "ARBITER_KAFKA_PORT"):
        monkeypatch.delenv(key, raising=False)
    settings = load_settings()
    assert settings.bootstrap == "127.0.0.1:9092"
    assert settings.processing_guarantee == "at_least_once"


def test_environment_with_one_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARBITER_BOOTSTRAP", "k1:9092, k2:9092")
    monkeypatch.setenv("ARBITER_PARTITIONS", "8")
    monkeypatch.setenv("ARBITER_PROCESSING_GUARANTEE", "exactly_once")
    monkeypatch.setenv("ARBITER_TOPICS__DEAD_LETTER", "acme.dlq")
    settings = load_settings()
    assert settings.bootstrap_list() == ["k1:9092", "k2:9092"]
    assert settings.partitions == 8
    assert settings.processing_guarantee == "exactly_once"
    assert settings.topics.dead_letter == "acme.dlq"
    assert settings.topics.resource_commands == "arbiter.resource.commands"


def test_explicit_option_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARBITER_BOOTSTRAP", "env:1")
    assert load_settings(bootstrap="cli:2").bootstrap == "cli:2"
    assert load_settings(bootstrap=None).bootstrap == "env:1"


def test_local_bootstrap_follows_the_local_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARBITER_BOOTSTRAP", raising=False)
    monkeypatch.setenv("ARBITER_KAFKA_PORT", "19092")
    assert load_settings().bootstrap == "127.0.0.1:19092"


@pytest.mark.parametrize(
    ("field", "value"),
    [("bootstrap", "no-port"), ("bootstrap", " , "), ("partitions", 0), ("processing_guarantee", "maybe")],
)
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        Settings(**{field: value})  # type: ignore[arg-type]


def test_topic_names_are_distinct() -> None:
    names = Settings().topics.all()
    assert len(names) == len(set(names)) == 10
