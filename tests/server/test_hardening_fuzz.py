"""Property-based fuzzing of request fields on both routes: every request is served or refused
in the protocol's error shape (never a 500, never a dropped socket), and the server ends idle."""

from __future__ import annotations

import json

import httpx
import pytest
from hardening_helpers import Baseline, start_hard_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import WSConn, run

pytestmark = pytest.mark.timeout(600)

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

# Any JSON value, small; integers include ones far past every limit.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.just(2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=8)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", ""])
content = st.text(max_size=40) | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                           "text": st.text(max_size=10) | json_values}), max_size=3) | json_values
messages = st.lists(st.fixed_dictionaries({"role": roles | json_values, "content": content}),
                    max_size=3) | json_values
speculation = (st.sampled_from(["off", "chain:2", "tree:4", "ngram:2", "adaptive", "static:x",
                                "tree:1000", "chain:-1", ""])
               | st.lists(st.lists(st.integers(-1, 3), max_size=3), max_size=6) | json_values)
# Output budgets stay small, so the requests that are accepted finish in a few steps.
budget = st.integers(-2, 6) | json_values


def _fields(budget_name: str):
    return st.fixed_dictionaries({budget_name: budget}, optional={
        "prompt": st.text(max_size=40) | st.lists(st.integers(-3, 400), max_size=8)
        | json_values,
        "messages": messages,
        "temperature": st.floats(-1, 3) | json_values,
        "top_p": st.floats(-0.5, 1.5) | json_values,
        "top_k": st.integers(-3, 400) | json_values,
        "seed": st.integers(-(2**70), 2**70) | json_values,
        "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=10) | json_values,
        "ignore_eos": st.booleans() | json_values,
        "speculation": speculation,
        "unknown_field": json_values,
    })


@pytest.fixture(scope="module")
def fuzz_server(tiny_target):
    srv = start_hard_server(tiny_target)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def baseline(fuzz_server):
    before = Baseline.settled(fuzz_server)
    yield
    before.wait_back(fuzz_server)


def _is_error_shape(event: dict) -> bool:
    return (event["type"] == "error" and isinstance(event["code"], str) and event["code"]
            and isinstance(event["message"], str) and "param" in event)


@FUZZ
@given(response=_fields("max_output_tokens"))
def test_websocket_request_fields(fuzz_server, response):
    async def go():
        async with WSConn(fuzz_server.ws) as conn:
            # The stdlib writes integers past 64 bits, which orjson (the server's parser) refuses.
            await conn.send(json.dumps({"type": "response.create", "request_id": "f",
                                        "response": response}))
            last = (await conn.until_done("f", timeout=60))["f"][-1]
            await conn.roundtrip_ok()
            return last

    last = run(go(), timeout=90)
    if last["type"] == "error":
        assert _is_error_shape(last), last
        assert last["code"] != "internal_error", last
    else:
        assert last["type"] == "response.done" and last["status"] in ("completed", "incomplete")


@FUZZ
@given(frame=st.text(max_size=60) | json_values.map(json.dumps))
def test_websocket_frames(fuzz_server, frame):
    async def go():
        async with WSConn(fuzz_server.ws) as conn:
            await conn.send(frame)
            await conn.send({"type": "ping", "event_id": "alive"})
            return [event async for event in _until_pong(conn)]

    events = run(go())
    assert all(_is_error_shape(e) for e in events), events


async def _until_pong(conn: WSConn):
    while (event := await conn.recv())["type"] != "pong":
        yield event


@FUZZ
@given(body=_fields("max_tokens"), model=st.sampled_from(["tiny"] * 4 + ["other"]))
def test_http_chat_request_fields(fuzz_server, body, model):
    body = {"model": model, **body}
    body.pop("prompt", None)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    with httpx.Client(timeout=60) as client:
        r = client.post(f"{fuzz_server.http}/v1/chat/completions", content=json.dumps(body),
                        headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    reply = r.json()
    if r.status_code != 200:
        assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
    else:
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
