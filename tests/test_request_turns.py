"""api.turns.RequestTurns: a burst of requests arriving together starts at most `per_turn`
of them per turn of the event loop, so what else the loop has to do (Redis replies, the
relays of open streams) runs between every `per_turn` starts; the requests still start in
arrival order, and one that goes away while it waits holds up nobody."""

from __future__ import annotations

import asyncio

import pytest

from api.turns import RequestTurns

HTTP = {"type": "http"}


def _recording_app(events: list):
    """An ASGI app whose start (all of its work, with no wait) is recorded by request number."""

    async def app(scope, receive, send):
        events.append(scope["n"])

    return app


async def _burst(per_turn: int, size: int, scope: dict = HTTP) -> list:
    """`size` requests arriving in one turn, then other work (an I/O callback) made ready in
    the same turn; the order in which the requests started and the other work ran."""
    events: list = []
    turns = RequestTurns(_recording_app(events), per_turn)
    requests = [asyncio.create_task(turns({**scope, "n": n}, None, None)) for n in range(size)]
    asyncio.get_running_loop().call_soon(events.append, "io")
    await asyncio.gather(*requests)
    return events


@pytest.mark.parametrize("per_turn", [1, 2, 3])
def test_a_burst_lets_other_work_run_after_each_turns_share_of_starts(per_turn):
    events = asyncio.run(_burst(per_turn, 7))
    assert events.index("io") == per_turn  # without turns it would run after all 7
    assert [event for event in events if event != "io"] == list(range(7))  # arrival order


def test_without_a_limit_a_burst_holds_the_loop_until_every_request_has_started():
    # What RequestTurns is for: the same burst with room for all of it in one turn.
    events = asyncio.run(_burst(per_turn=100, size=7))
    assert events == [0, 1, 2, 3, 4, 5, 6, "io"]


def test_a_request_that_goes_away_while_waiting_holds_up_nobody():
    async def run() -> list:
        events: list = []
        turns = RequestTurns(_recording_app(events), per_turn=1)
        requests = [asyncio.create_task(turns({**HTTP, "n": n}, None, None)) for n in range(4)]
        await asyncio.sleep(0)  # request 0 started, the others wait for their turns
        requests[1].cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        assert requests[1].cancelled()
        return events

    assert asyncio.run(run()) == [0, 2, 3]


def test_requests_after_a_burst_start_at_once_again():
    async def run() -> list:
        events: list = []
        turns = RequestTurns(_recording_app(events), per_turn=2)
        await asyncio.gather(*(turns({**HTTP, "n": n}, None, None) for n in range(5)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # The loop has turned since: a lone request has its turn without waiting for one.
        task = asyncio.create_task(turns({**HTTP, "n": 5}, None, None))
        await asyncio.sleep(0)
        assert task.done()
        return events

    assert asyncio.run(run()) == [0, 1, 2, 3, 4, 5]


def test_other_scopes_pass_straight_through():
    assert asyncio.run(_burst(per_turn=1, size=3, scope={"type": "lifespan"})) == [0, 1, 2, "io"]


def test_an_app_run_on_a_new_loop_is_not_stuck_on_a_turn_the_old_loop_never_began():
    events: list = []
    turns = RequestTurns(_recording_app(events), per_turn=2)

    async def burst() -> None:
        for n in range(2):
            await turns({**HTTP, "n": n}, None, None)

    old = asyncio.new_event_loop()
    # Two requests take the turn's whole share; the loop stops before its next turn begins.
    done = old.create_task(burst())
    old.call_soon(old.stop)
    old.run_forever()
    assert done.done()
    old.close()

    async def later() -> None:
        await asyncio.wait_for(turns({**HTTP, "n": 2}, None, None), timeout=5)

    asyncio.run(later())
    assert events == [0, 1, 2]
