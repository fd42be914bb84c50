"""The broker's jars: named by ``pom.xml``, copied from Maven Central once per release, and stamped
with the pom's and the release's hash so a later ``up`` knows whether to fetch again."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from .errors import LocalKafkaError

POM = Path(__file__).resolve().parent / "pom.xml"


def release(version: str) -> tuple[int, ...]:
    """A release's number as a tuple that compares in release order (``"3.9.1"``: ``(3, 9, 1)``)."""
    return tuple(int(part) for part in version.split("."))


def log_binding(version: str) -> list[str]:
    """Maven properties for the broker's slf4j binding: log4j 2 from Kafka 4 on, reload4j before."""
    if release(version) >= (4,):
        # The slf4j 1.7 binding: Kafka 4 still logs through slf4j-api 1.7.36, as its distribution ships.
        group, artifact, at = "org.apache.logging.log4j", "log4j-slf4j-impl", "2.25.5"
    else:
        group, artifact, at = "org.slf4j", "slf4j-reload4j", "1.7.36"
    return [f"-Dlog.groupId={group}", f"-Dlog.artifactId={artifact}", f"-Dlog.version={at}"]


def jar_stamp(version: str) -> str:
    """The stamp of the jars of this pom at ``version``: a hash of both."""
    return hashlib.sha256(POM.read_bytes() + version.encode()).hexdigest()


def copy_jars(libs: Path, version: str, say: Callable[[str], None]) -> None:
    """Copy the jars of Kafka ``version`` from Maven Central into ``libs``, emptied first (no stamp)."""
    mvn = shutil.which("mvn")
    if not mvn:
        raise LocalKafkaError("Maven (mvn) is needed once, to fetch the Kafka broker's jars; install it")
    say(f"fetching the jars of Kafka {version} from Maven Central (once)...")
    if libs.exists():
        shutil.rmtree(libs)
    libs.mkdir(parents=True)
    proc = subprocess.run(
        [mvn, "-B", "-q", "-f", str(POM), "dependency:copy-dependencies", f"-Darbiter.libs={libs}",
         f"-Dkafka.version={version}", *log_binding(version)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise LocalKafkaError(f"Maven could not fetch the jars of Kafka {version} (ARBITER_KAFKA_VERSION)",
                              (proc.stdout + proc.stderr)[-4000:])
    if not list(libs.glob("kafka_*.jar")):
        raise LocalKafkaError(f"Maven ran, but no broker jar arrived in {libs}",
                              (proc.stdout + proc.stderr)[-4000:])
