"""Every front-door route that takes a name in its URL works with the names Arbiter itself hands out.

Saga ids look like ``saga:<agent>/<name>:<id>`` (a '/' and two ':'), resources like ``doc:a/b``, and
either may hold any character (a saga's name may be non-ASCII). The routes are enumerated from the
door's own application, so a new route that takes a name gets no pass until it has a case here; each
case calls the route with curl (a real door, a real worker), the name sent as it is where a client
would send it so, percent-encoded, and encoded with '/' kept (what ``urllib.parse.quote`` does).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Registrar
from arbiter.door.app import create_app
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, WorkerPool, settings_env, wait_until_served
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import isolated_settings
from tests.door.test_door_http import Answer, curl, until

pytestmark = pytest.mark.kafka

AGENT = "qa.bot@team:7"
"""An agent whose name uses every kind of character a name may hold besides letters and digits."""
ENCODINGS: dict[str, Callable[[str], str]] = {
    "raw": lambda name: name,
    "encoded": lambda name: urllib.parse.quote(name, safe=""),
    "slashes-kept": lambda name: urllib.parse.quote(name),
}
"""How a client may put a name in a URL: as it is (curl sends non-ASCII as UTF-8), every reserved
character percent-encoded, or with '/' left as it is."""
URL_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~/:@")


@dataclass
class Front:
    settings: Settings
    door: DoorProcess
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.door.url

    def call(self, method: str, path: str, body: Any = None) -> Answer:
        return curl(method, self.url + path, key=self.keys[AGENT], body=body)


async def _start(settings: Settings, pool: WorkerPool) -> dict[str, str]:
    await ensure_topics(settings)
    pool.start(1)
    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    async with ArbiterClient("warmup", settings) as client:
        await wait_until_served(client, pool, keys)
    registrar = Registrar(settings)
    await registrar.add(AGENT)
    return {AGENT: (await registrar.issue_credential(AGENT, label="paths"))[0].api_key()}


@pytest.fixture(scope="module")
def front(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    settings = isolated_settings(bootstrap, tmp_path_factory.mktemp("door_paths"))
    pool = WorkerPool(settings)
    door = DoorProcess(settings)
    try:
        keys = asyncio.run(_start(settings, pool))
        door.start()
        yield Front(settings, door, keys)
    finally:
        door.stop()
        pool.stop()


def _routes(routes: list[BaseRoute]) -> Iterator[BaseRoute]:
    """Every route, those of the routers the app includes too."""
    for route in routes:
        included = getattr(route, "original_router", None)  # an included router (FastAPI keeps them whole)
        if included is not None:
            yield from _routes(included.routes)
        else:
            yield route


def _named_routes() -> list[str]:
    """``METHOD template`` of every route of the door that takes a name: a path parameter, a string
    query parameter, or a mount (which serves whatever path follows it)."""
    app = create_app(Settings(bootstrap="127.0.0.1:1"))  # never started: only its routes are read
    found = []
    for route in _routes(app.routes):
        if isinstance(route, Mount):
            found.append(f"GET {route.path}/...")
            continue
        assert isinstance(route, Route | WebSocketRoute), f"a route of a kind this test does not know: {route!r}"
        dependant = getattr(route, "dependant", None)
        strings = [p for p in dependant.query_params if p.field_info.annotation is str] if dependant else []
        if route.param_convertors or strings:
            found += [f"{method} {route.path}" for method in sorted(getattr(route, "methods", None) or {"WEBSOCKET"})
                      if method != "HEAD"]
    return sorted(found)


def sendable_raw(name: str) -> bool:
    """Whether a client could put ``name`` in a URL as it is (nothing in it ends or changes a path)."""
    return all(c in URL_SAFE or ord(c) > 127 for c in name)


def forms(name: str) -> list[tuple[str, str]]:
    """(encoding, how the name goes in a URL), for each way a client would send it."""
    return [(how, encode(name)) for how, encode in ENCODINGS.items() if how != "raw" or sendable_raw(name)]


# -- one case per route ---------------------------------------------------------------------------------------


SAGA_NAMES = ("rückbau-ü", "odd#?%&=name")
"""A saga's name is anything without '/' or white space."""
RESOURCES = ("doc:a/b", "doc:ünï/çødé:1", "doc:a//b/", "doc:a?b#c%d e&f=g", "/doc:leading")


def resources(front: Front) -> None:
    for resource in RESOURCES:
        for how, sent in forms(resource):
            answer = front.call("GET", f"/v1/resources/{sent}?content=true")
            assert answer.status == 200, (resource, how, answer.text)
            assert answer.json["resource"] == resource, (resource, how, answer.json)


def _saga(front: Front, name: str = "rückbau-ü") -> str:
    started = front.call("POST", "/v1/sagas", {"name": name})
    assert started.status == 200, started.text
    saga_id: str = started.json["saga_id"]
    assert saga_id.startswith(f"saga:{AGENT}/{name}:"), saga_id
    return saga_id


def _step(front: Front, saga_id: str, sent: str, resource: str, version: int) -> Answer:
    return front.call("POST", f"/v1/sagas/{sent}/steps", {
        "resource": resource, "tool": "commit", "args": {"patch": {"steps": version + 1}}, "base_version": version,
        "compensate": {"tool": "commit", "args": {"patch": {"undone": True}}}})


def _open_sagas(front: Front) -> list[str]:
    status = front.call("GET", "/v1/status")
    assert status.status == 200, status.text
    sagas: list[str] = status.json["sagas"]
    return sagas


def saga_steps(front: Front) -> None:
    for name in SAGA_NAMES:
        saga_id, resource = _saga(front, name), f"doc:paths/steps/{name}"
        for version, (how, sent) in enumerate(forms(saga_id)):
            step = _step(front, saga_id, sent, resource, version)
            assert step.status == 200 and step.json["applied"] is True, (how, step.text)
        ended = front.call("POST", f"/v1/sagas/{urllib.parse.quote(saga_id, safe='')}/complete")
        assert ended.status == 200 and ended.json["outcome"] == "COMPLETED", ended.text


def _end_each_way(front: Front, action: str, expected: str) -> None:
    for name in SAGA_NAMES:
        for how, encode in ENCODINGS.items():
            if how == "raw" and not sendable_raw(name):
                continue
            saga_id = _saga(front, name)
            sent = encode(saga_id)
            assert _step(front, saga_id, ENCODINGS["encoded"](saga_id), f"doc:paths/{action}/{how}/{name}",
                         0).status == 200
            assert saga_id in _open_sagas(front)
            ended = front.call("POST", f"/v1/sagas/{sent}/{action}", {"reason": "test"} if action == "abort" else None)
            assert ended.status == 200, (how, ended.text)
            assert (ended.json["saga_id"], ended.json["outcome"]) == (saga_id, expected), (how, ended.json)
            assert saga_id not in _open_sagas(front), how


def saga_complete(front: Front) -> None:
    _end_each_way(front, "complete", "COMPLETED")


def saga_abort(front: Front) -> None:
    _end_each_way(front, "abort", "COMPENSATED")


def console_script(front: Front) -> None:
    assert curl("GET", f"{front.url}/console/console.js").status == 200
    for name in ("nothing", "..%2Fconsole", "%2E%2E"):
        missing = curl("GET", f"{front.url}/console/{name}.js")
        assert missing.status == 404, (name, missing.text)


def docs_assets(front: Front) -> None:
    answer = curl("GET", f"{front.url}/docs/assets/swagger-ui.css")
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/css"), answer.headers
    assert curl("GET", f"{front.url}/docs/assets/..%2F..%2Fapp.py").status == 404


def console_history(front: Front) -> None:
    resource = "doc:history/ü?x=1&y#z"
    granted = front.call("POST", "/v1/leases/acquire", {"resource": resource, "ttl": 30})
    assert granted.status == 200, granted.text
    try:
        sent = urllib.parse.quote(resource, safe="")
        history = curl("GET", f"{front.url}/console/history?name={sent}")
        assert history.status == 200 and history.json["name"] == resource, history.text
        assert [e["kind"] for e in history.json["events"]] == ["granted"], history.json
    finally:
        front.call("POST", "/v1/leases/release", {"resource": resource, "token": granted.json["token"]})


CASES: dict[str, Callable[[Front], None]] = {
    "GET /v1/resources/{resource:path}": resources,
    "POST /v1/sagas/{saga_id:path}/steps": saga_steps,
    "POST /v1/sagas/{saga_id:path}/complete": saga_complete,
    "POST /v1/sagas/{saga_id:path}/abort": saga_abort,
    "GET /console/{name}.js": console_script,
    "GET /docs/assets/...": docs_assets,
    "GET /console/history": console_history,
}


@pytest.mark.parametrize("route", _named_routes())
def test_every_route_that_takes_a_name_takes_arbiters_own_names(front: Front, route: str) -> None:
    case = CASES.get(route)
    if case is None:
        pytest.fail(f"{route} takes a name in its URL and has no case in CASES: add one that calls it with "
                    f"ids as Arbiter hands them out, raw and percent-encoded", pytrace=False)
    case(front)


def test_every_case_is_a_route_of_the_door() -> None:
    assert sorted(CASES) == _named_routes()


# -- sagas that outlive their caller ---------------------------------------------------------------------------


def _saga_abort_cli(front: Front, saga_id: str) -> None:
    """``arbiter saga abort``: an operator's abort, from outside the door."""
    done = subprocess.run([sys.executable, "-m", "arbiter", "saga", "abort", saga_id, "--reason", "test: stuck"],
                          env=settings_env(front.settings), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _content(front: Front, resource: str) -> Any:
    answer = front.call("GET", f"/v1/resources/{urllib.parse.quote(resource, safe='')}?content=true")
    assert answer.status == 200, answer.text
    return answer.json["content"]


@pytest.mark.parametrize("steps", [1, 0])
def test_a_saga_an_operator_aborts_leaves_the_door_and_answers_how_it_ended(front: Front, steps: int) -> None:
    saga_id, resource = _saga(front, f"stuck-{steps}"), f"doc:paths/operator/{steps}"
    for version in range(steps):
        assert _step(front, saga_id, saga_id, resource, version).status == 200
    assert saga_id in _open_sagas(front)

    _saga_abort_cli(front, saga_id)
    until("the aborted saga leaves /v1/status", lambda: saga_id not in _open_sagas(front), timeout=30)
    if steps:
        assert _content(front, resource)["body"] == {"steps": 1, "undone": True}  # compensated
    # Its caller comes back: every end answers how it ended, a step is refused.
    for action in ("complete", "abort"):
        ended = front.call("POST", f"/v1/sagas/{saga_id}/{action}", {"reason": "late"} if action == "abort" else None)
        assert ended.status == 200 and ended.json["outcome"] == "COMPENSATED", (action, ended.text)
    late = _step(front, saga_id, saga_id, resource, steps)
    assert late.status == 409 and late.json["reason"] == "saga_ended", late.text


def test_a_saga_with_no_steps_completes(front: Front) -> None:
    saga_id = _saga(front, "empty")
    ended = front.call("POST", f"/v1/sagas/{saga_id}/complete")
    assert ended.status == 200 and ended.json["outcome"] == "COMPLETED", ended.text
    assert saga_id not in _open_sagas(front)


def test_a_saga_whose_process_is_gone_is_aborted_through_the_door(front: Front) -> None:
    resource = "doc:paths/orphan/ü"

    async def abandon() -> str:
        client = ArbiterClient(AGENT, front.settings)
        await client.start()
        saga = client.open_saga("orphan")
        await saga.step(resource, "commit", {"patch": {"steps": 1}}, base_version=0,
                        compensate=("commit", {"patch": {"undone": True}}))
        await client.close()  # and never ends its saga
        return saga.saga_id

    saga_id = asyncio.run(abandon())
    assert saga_id not in _open_sagas(front)
    asked = front.call("POST", f"/v1/sagas/{saga_id}/abort", {"reason": "its process is gone"})
    assert asked.status == 202 and asked.json["requested"] is True and asked.json["outcome"] is None, asked.text
    until("the orphan compensated", lambda: _content(front, resource)["body"] == {"steps": 1, "undone": True},
          timeout=30)
    again = until("the door knows how it ended", lambda: (a := front.call(
        "POST", f"/v1/sagas/{saga_id}/abort", {"reason": "again"})).status == 200 and a)
    assert again.json["outcome"] == "COMPENSATED", again.text

    # Another agent's saga is not this agent's to abort.
    other = front.call("POST", "/v1/sagas/saga:someone-else/theirs:0/abort", {"reason": "mine now"})
    assert other.status == 403 and other.json["reason"] == "forbidden", other.text
    missing = front.call("POST", f"/v1/sagas/saga:{AGENT}/never:0/complete")
    assert missing.status == 404 and missing.json["reason"] == "unknown_saga", missing.text
