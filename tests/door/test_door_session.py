"""The front door's WebSocket session as a machine with no socket: frames in, what to do out, frames queued."""

from __future__ import annotations

import asyncio
import json

from arbiter.door.session import Auth, Command, Phase, Reply, Session, receive


def test_a_session_without_a_header_starts_with_an_auth_frame_and_nothing_else() -> None:
    assert receive(Phase.AUTH, '{"op": "auth", "api_key": "arb2.x.y"}') == Auth("arb2.x.y")
    cases = {"not json": "not a JSON object", '["auth"]': "not a JSON object", None: "not text",
             '{"op": "send"}': "op is 'send'", '{"op": "auth"}': "no api_key"}
    for text, wrong in cases.items():
        answer = receive(Phase.AUTH, text)
        assert isinstance(answer, Reply) and answer.refuse, text
        assert answer.frame["status"] == 401 and '"op": "auth"' in answer.frame["detail"], text
        assert wrong in answer.frame["detail"], (text, answer.frame["detail"])


def test_an_open_session_takes_commands_and_pings_and_names_what_is_wrong_with_anything_else() -> None:
    assert receive(Phase.OPEN, '{"op": "send", "id": 3, "key": "doc:x", "record": {"type": "Ping"}}') \
        == Command(3, "doc:x", {"type": "Ping"})
    assert receive(Phase.OPEN, '{"op": "ping", "id": 9}') == Reply({"op": "pong", "id": 9})
    bad = receive(Phase.OPEN, "{oops")
    assert isinstance(bad, Reply) and bad.frame["reason"] == "malformed_json" and not bad.refuse
    unknown = receive(Phase.OPEN, '{"op": "dance", "id": 1}')
    assert isinstance(unknown, Reply) and unknown.frame["reason"] == "unknown_op" and unknown.frame["id"] == 1


def test_events_are_forwarded_once_in_offset_order_across_a_resume() -> None:
    async def run() -> list[str]:
        session = Session("a", limit=10, since=5)
        session.push(8, "live-8")          # arrives while the log is being read back: held
        await session.replayed(5, "log-5")
        await session.replayed(6, "log-6")
        await session.replayed(7, "log-7")
        session.live()                     # the held one goes out after the replayed ones
        session.push(8, "live-8-again")    # the same offset twice: once
        session.push(9, "live-9")
        out = []
        while not session.queue.empty():
            frame = await session.next_frame()
            assert frame is not None
            out.append(frame)
        return out

    assert asyncio.run(run()) == ["log-5", "log-6", "log-7", "live-8", "live-9"]


def test_a_peer_that_reads_nothing_is_closed_as_a_slow_consumer_never_waited_for() -> None:
    session = Session("a", limit=3, since=0)
    session.replaying = False
    for offset in range(5):
        session.push(offset, f"event-{offset}")
    assert session.closed_because is not None and session.closed_because.startswith("slow consumer")


def test_answers_to_the_agents_own_frames_wait_for_room_then_give_up() -> None:
    async def run() -> str | None:
        session = Session("a", limit=2, since=0)
        await session.answer({"op": "ack", "id": 1}, patience=0.05)  # half the buffer: queued at once
        await session.answer({"op": "ack", "id": 2}, patience=0.05)  # no room, nobody reads: gives up
        assert json.loads(session.queue.get_nowait() or "{}")["id"] == 1
        return session.closed_because

    assert (asyncio.run(run()) or "").startswith("slow consumer")
