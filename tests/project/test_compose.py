"""docker-compose.yml agrees with the project's settings (there is no Docker engine to run it)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from arbiter.edge.settings import Settings
from tests.conftest import REPO

COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def test_services() -> None:
    assert set(SERVICES) == {"kafka", "topics", "worker"}


def test_kafka_is_the_official_image_at_the_pinned_version_in_kraft_mode() -> None:
    pom = (REPO / "arbiter" / "kafka" / "pom.xml").read_text()
    (version,) = re.findall(r"<kafka.version>([^<]+)</kafka.version>", pom)
    kafka = SERVICES["kafka"]
    assert kafka["image"] == f"apache/kafka:{version}"
    assert Settings().kafka_version == version, "arbiter kafka up runs the release the compose file does"
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "ZOOKEEPER" not in " ".join(env)
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert env["KAFKA_LOG_RETENTION_MS"] == "-1"
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) >= 2 * Settings().max_message_bytes


def test_host_port_is_the_default_local_port() -> None:
    settings = Settings()
    kafka = SERVICES["kafka"]
    assert f"{settings.kafka_port}:{settings.kafka_port}" in kafka["ports"]
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"EXTERNAL://localhost:{settings.kafka_port}" in advertised.split(",")


def test_arbiter_services_use_real_settings_and_reach_the_internal_listener() -> None:
    fields = set(Settings.model_fields)
    advertised = SERVICES["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
    internal = next(a.split("//")[1] for a in advertised if a.startswith("INTERNAL://"))
    for name in ("topics", "worker"):
        env = SERVICES[name]["environment"]
        for key in env:
            assert key.startswith("ARBITER_"), key
            assert key.removeprefix("ARBITER_").lower() in fields, f"{name}: {key} is not a setting"
        settings = Settings(**{k.removeprefix("ARBITER_").lower(): v for k, v in env.items()})
        assert settings.bootstrap == internal
        assert settings.partitions == Settings().partitions


def test_worker_scales() -> None:
    worker = SERVICES["worker"]
    assert "container_name" not in worker and "ports" not in worker
    assert worker["command"][:2] == ["arbiter", "worker"]
    assert worker["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert SERVICES["topics"]["command"] == ["arbiter", "topics", "create"]


def test_image_installs_everything_the_worker_imports() -> None:
    """The image copies every folder the wheel takes a portion of ``arbiter`` from (pyproject.toml's
    ``only-include``), and installs the worker's and the door's extras."""
    import tomllib

    dockerfile = (REPO / "Dockerfile").read_text()
    wheel = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    folders = sorted({path.split("/")[0] for path in wheel["only-include"]})
    assert folders == ["agents", "arbiter", "edge", "schemas", "streams"], folders
    for folder in folders:
        assert (REPO / folder).is_dir(), folder
        assert f"COPY {folder} ./{folder}" in dockerfile, folder
    assert 'pip install --no-cache-dir ".[all]"' in dockerfile
