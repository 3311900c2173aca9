"""The specserve.v1 WebSocket protocol against a real uvicorn, with the `websockets` client."""

from __future__ import annotations

import pytest
from server_helpers import WSConn, done_of, run, text_of

from specserve import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPT = "def add(a, b):"


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_stream_equals_llm_generate(server, reference):
    async def go():
        async with WSConn(server.ws) as c:
            await c.create("r1", prompt=PROMPT, temperature=0, max_output_tokens=24,
                           ignore_eos=True, speculation_events=True)
            return (await c.until_done("r1"))["r1"]

    events = run(go())
    expected = reference.generate(PROMPT, _greedy(24))[0]
    assert events[0]["type"] == "response.created"
    assert events[0]["response"]["input_tokens"] == len(expected.prompt_token_ids)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    steps = [e for e in events if e["type"] == "response.speculation.step"]
    assert text_of(events) == expected.text
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))
    # One speculation event per delta, same seq, and their token ids are the output.
    assert [s["seq"] for s in steps] == [d["seq"] for d in deltas]
    assert [t for s in steps for t in s["token_ids"]] == expected.token_ids
    assert sum(d["n_tokens"] for d in deltas) == 24
    # Self-drafting: all drafts are accepted, so steps commit several tokens.
    assert max(d["n_tokens"] for d in deltas) > 1
    assert sum(d["n_draft_accepted"] for d in deltas) == done_of(events)["metrics"][
        "num_accepted_tokens"] > 0
    done = done_of(events)
    assert (done["status"], done["reason"]) == ("incomplete", "max_output_tokens")
    assert done["usage"] == {"input_tokens": len(expected.prompt_token_ids),
                             "output_tokens": 24,
                             "total_tokens": len(expected.prompt_token_ids) + 24}
    assert done["metrics"]["acceptance_length"] > 1.0
    assert done["metrics"]["ttft_ms"] <= done["metrics"]["e2e_ms"]
    # Self-drafting accepts every drafted depth; stage times are part of the request's time.
    assert done["metrics"]["acceptance_rate_per_pos"]
    assert set(done["metrics"]["acceptance_rate_per_pos"]) == {1.0}
    stage_ms = done["metrics"]["draft_ms"] + done["metrics"]["verify_ms"]
    assert 0 < stage_ms <= done["metrics"]["e2e_ms"]


def test_chat_messages_use_the_chat_template(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]

    async def go():
        async with WSConn(server.ws) as c:
            await c.create("chat", messages=messages, temperature=0, max_output_tokens=12)
            return (await c.until_done("chat"))["chat"]

    events = run(go())
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    expected = reference.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0]
    assert text_of(events) == expected.text
    assert done_of(events)["usage"]["output_tokens"] == len(expected.token_ids)


def test_two_concurrent_requests_on_one_socket(server, reference):
    prompts = {"a": PROMPT, "b": "The quick brown fox"}

    async def go():
        async with WSConn(server.ws) as c:
            for rid, prompt in prompts.items():
                await c.create(rid, prompt=prompt, temperature=0, max_output_tokens=40,
                               ignore_eos=True)
            events = await c.until_done("a", "b")
            # The engine had both at once: each was in flight while the other streamed.
            return events

    events = run(go())
    for rid, prompt in prompts.items():
        assert done_of(events[rid])["status"] == "incomplete"
        assert text_of(events[rid]) == reference.generate(prompt, _greedy(40))[0].text


def test_cancel_stops_the_request_and_frees_its_blocks(server):
    async def go():
        async with WSConn(server.ws) as c:
            await c.create("long", prompt=PROMPT, temperature=0, max_output_tokens=400,
                           ignore_eos=True)
            while (await c.recv())["type"] != "response.output_text.delta":
                pass
            await c.send({"type": "response.cancel", "request_id": "long"})
            events = (await c.until_done("long"))["long"]
            # The id is free again at once, and the socket keeps serving.
            await c.create("long", prompt=PROMPT, temperature=0, max_output_tokens=3)
            again = (await c.until_done("long"))["long"]
            return events, again

    events, again = run(go())
    done = done_of(events)
    assert (done["status"], done["reason"]) == ("cancelled", "client_cancelled")
    assert done["usage"]["output_tokens"] < 400
    assert done_of(again)["status"] in ("completed", "incomplete")
    server.wait_idle()


def test_closing_the_socket_cancels_everything_on_it(server):
    finished_before = server.core.stats.num_finished

    async def go():
        async with WSConn(server.ws) as c:
            for rid in ("x", "y"):
                await c.create(rid, prompt=PROMPT, max_output_tokens=400, ignore_eos=True)
            seen = set()
            while seen != {"x", "y"}:
                event = await c.recv()
                if event["type"] == "response.output_text.delta":
                    seen.add(event["request_id"])
            assert server.engine.num_in_flight() == 2
        # leaving the block closes the socket with both requests mid-generation

    run(go())
    server.wait_idle()  # the engine is empty, every block is back
    # ... because both were aborted, not because they ran to their 400 tokens.
    assert server.core.stats.num_finished == finished_before


def test_session_update_sets_defaults(server):
    async def go():
        async with WSConn(server.ws) as c:
            await c.send({"type": "session.update", "event_id": "u1",
                          "session": {"defaults": {"max_output_tokens": 5, "ignore_eos": True,
                                                   "temperature": 0}}})
            updated = await c.recv()
            await c.create("d", prompt=PROMPT)
            events = (await c.until_done("d"))["d"]
            await c.create("e", prompt=PROMPT, max_output_tokens=2)  # the request wins
            return updated, events, (await c.until_done("e"))["e"]

    updated, events, override = run(go())
    assert updated["type"] == "session.updated"
    assert updated["session"]["defaults"] == {"max_output_tokens": 5, "ignore_eos": True,
                                              "temperature": 0.0}
    assert done_of(events)["usage"]["output_tokens"] == 5
    assert done_of(override)["usage"]["output_tokens"] == 2


def test_session_created_reports_limits_and_ping_answers(server):
    async def go():
        async with WSConn(server.ws) as c:
            await c.send({"type": "ping", "event_id": "p7"})
            return c.session, await c.recv()

    session, pong = run(go())
    assert session["model"] == "tiny" and session["speculation"] == "chain:3"
    assert session["limits"] == server.app.state.server.limits.as_dict()
    assert session["limits"]["max_requests_in_flight"] == 3
    assert pong == {"type": "pong", "event_id": "p7"}


# ---- protocol errors: each gives its documented error event and the socket keeps serving ----
_LONG_PROMPT = [10 + i % 300 for i in range(600)]  # token ids, over the 511-token limit
_ERROR_CASES = {
    "not json": ("{nope", "invalid_json", None),
    "json array": ("[1, 2]", "invalid_json", None),
    "binary frame": (b"\x00\x01", "binary_not_supported", None),
    "no type": ({"request_id": "q"}, "unknown_event", "type"),
    "unknown type": ({"type": "response.explode"}, "unknown_event", "type"),
    "missing request_id": ({"type": "response.create", "response": {"prompt": "x"}},
                           "invalid_field", "request_id"),
    "wrong type": ({"type": "response.create", "request_id": "q",
                    "response": {"prompt": "x", "temperature": "hot"}},
                   "invalid_field", "response.temperature"),
    "out of range": ({"type": "response.create", "request_id": "q",
                      "response": {"prompt": "x", "top_p": 1.5}},
                     "invalid_field", "response.top_p"),
    "unknown field": ({"type": "response.create", "request_id": "q",
                       "response": {"prompt": "x", "temprature": 0}},
                      "invalid_field", "response.temprature"),
    "bad role": ({"type": "response.create", "request_id": "q",
                  "response": {"messages": [{"role": "wizard", "content": "x"}]}},
                 "invalid_field", "response.messages[0].role"),
    "prompt and messages": ({"type": "response.create", "request_id": "q",
                             "response": {"prompt": "x",
                                          "messages": [{"role": "user", "content": "x"}]}},
                            "invalid_field", "response.messages"),
    "no prompt": ({"type": "response.create", "request_id": "q", "response": {}},
                  "invalid_field", "response.messages"),
    "bad token id": ({"type": "response.create", "request_id": "q",
                      "response": {"prompt": [1, 99999]}}, "invalid_field", "response.prompt"),
    "too many output tokens": ({"type": "response.create", "request_id": "q",
                                "response": {"prompt": "x", "max_output_tokens": 100000}},
                               "invalid_field", "response.max_output_tokens"),
    "prompt too long": ({"type": "response.create", "request_id": "q",
                         "response": {"prompt": _LONG_PROMPT}},
                        "prompt_too_long", "response.prompt"),
    "prompt + output too long": ({"type": "response.create", "request_id": "q",
                                  "response": {"prompt": _LONG_PROMPT[:500],
                                               "max_output_tokens": 100}},
                                 "prompt_too_long", "response.max_output_tokens"),
    "bad speculation": ({"type": "response.create", "request_id": "q",
                         "response": {"prompt": "x", "speculation": "chain:zero"}},
                        "invalid_field", "response.speculation"),
    "bad default": ({"type": "session.update", "session": {"defaults": {"speculation": "warp"}}},
                    "invalid_field", "session.defaults.speculation"),
    "cancel unknown": ({"type": "response.cancel", "request_id": "ghost"},
                       "unknown_request_id", "request_id"),
    "too large": ({"type": "ping", "pad": "x" * 70000}, "message_too_large", None),
}


@pytest.mark.parametrize("frame,code,param", list(_ERROR_CASES.values()), ids=list(_ERROR_CASES))
def test_protocol_error(server, frame, code, param):
    if isinstance(frame, dict):
        frame = {**frame, "event_id": "ev-1"}

    async def go():
        async with WSConn(server.ws) as c:
            await c.send(frame)
            error = await c.recv()
            await c.roundtrip_ok()
            await c.create("after", prompt=PROMPT, max_output_tokens=2)
            return error, (await c.until_done("after"))["after"]

    error, after = run(go())
    assert error["type"] == "error", error
    assert (error["code"], error["param"]) == (code, param), error
    assert error["message"]
    assert error["event_id"] == ("ev-1" if isinstance(frame, dict) and code !=
                                 "message_too_large" else None)
    if isinstance(frame, dict) and "request_id" in frame:
        assert error["request_id"] == frame["request_id"]
    # The refused request never started, and the socket serves the next one.
    assert done_of(after)["usage"]["output_tokens"] == 2
    assert server.engine.core.stats.num_finished >= 1


def test_duplicate_request_id_and_in_flight_limit(server):
    async def go():
        async with WSConn(server.ws) as c:
            for rid in ("1", "2", "3"):
                await c.create(rid, prompt=PROMPT, max_output_tokens=300, ignore_eos=True)
            await c.create("2", prompt=PROMPT)
            await c.create("4", prompt=PROMPT)
            errors = []
            while len(errors) < 2:
                event = await c.recv()
                if event["type"] == "error":
                    errors.append(event)
            for rid in ("1", "2", "3"):
                await c.send({"type": "response.cancel", "request_id": rid})
            done = await c.until_done("1", "2", "3")
            return errors, done

    errors, done = run(go())
    assert [(e["code"], e["request_id"]) for e in errors] == [
        ("duplicate_request_id", "2"), ("too_many_requests", "4")]
    assert errors[0]["param"] == "request_id"
    # The duplicate did not disturb the request already using the id.
    assert all(done_of(done[rid])["status"] == "cancelled" for rid in ("1", "2", "3"))


def test_two_sockets_may_use_the_same_request_id(server):
    async def go():
        async with WSConn(server.ws) as a, WSConn(server.ws) as b:
            await a.create("same", prompt=PROMPT, temperature=0, max_output_tokens=6)
            await b.create("same", prompt=PROMPT, temperature=0, max_output_tokens=6)
            return (await a.until_done("same"))["same"], (await b.until_done("same"))["same"]

    ea, eb = run(go())
    assert text_of(ea) == text_of(eb) and done_of(ea)["status"] == done_of(eb)["status"]


def test_engine_failure_ends_the_request_as_failed_and_the_server_recovers(server):
    runner = server.core.runner
    real_forward = runner.forward
    calls = {"n": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real_forward(*args, **kwargs)

    async def go():
        async with WSConn(server.ws) as c:
            runner.forward = failing_forward
            try:
                await c.create("f", prompt=PROMPT, max_output_tokens=5)
                failed = (await c.until_done("f"))["f"]
            finally:
                del runner.forward  # back to the class's method
            await c.create("ok", prompt=PROMPT, max_output_tokens=5, ignore_eos=True)
            return failed, (await c.until_done("ok"))["ok"]

    failed, ok = run(go())
    done = done_of(failed)
    assert (done["status"], done["reason"]) == ("failed", "error")
    assert done["error"]["code"] == "engine_error"
    assert "injected forward failure" in done["error"]["message"]
    assert done_of(ok)["usage"]["output_tokens"] == 5


def test_missing_subprotocol_is_closed_with_4400(server):
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def go():
        async with connect(server.ws, proxy=None, open_timeout=10) as ws:
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()
            return info.value.rcvd.code

    assert run(go()) == 4400


def test_engine_not_running_is_server_unavailable(server):
    """Starlette's TestClient without its context manager skips the lifespan: no engine."""
    from starlette.testclient import TestClient

    from specserve.engine.async_engine import AsyncEngine
    from specserve.server import create_app

    # An AsyncEngine that is never started only reads the core's configuration.
    client = TestClient(create_app(AsyncEngine(server.core), model_name="tiny",
                                   allowed_hosts=None))  # its Host is "testserver"
    assert client.get("/health").status_code == 503
    with client.websocket_connect("/v1/ws", subprotocols=["specserve.v1"]) as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"type": "response.create", "request_id": "r",
                      "response": {"prompt": PROMPT}})
        error = ws.receive_json()
    assert (error["code"], error["request_id"]) == ("server_unavailable", "r")
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "abc"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_unavailable"
