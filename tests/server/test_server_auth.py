"""API key (header or `bearer.` subprotocol) and Origin checks, on a server started with a key."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import WSConn, run, start_server

from specserve.client import AsyncClient, AuthenticationError

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-0123456789"
GOOD_ORIGIN = "http://ui.example:3000"


@pytest.fixture(scope="module")
def auth_server(tiny_target: Path):
    srv = start_server(tiny_target, None, None, api_key=KEY, allowed_origins=[GOOD_ORIGIN])
    yield srv
    srv.stop()


def _close_code(url: str, **options) -> int:
    from websockets.exceptions import ConnectionClosed

    async def go():
        try:
            async with WSConn(url, **options):
                return 1000
        except ConnectionClosed as exc:
            return exc.rcvd.code

    return run(go())


@pytest.mark.parametrize("path", ["/v1/models", "/metrics"])
def test_http_routes_need_the_key(auth_server, path):
    url = auth_server.http + path
    r = httpx.get(url, timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).status_code == 200


def test_health_is_open_and_says_a_key_is_needed(auth_server):
    r = httpx.get(auth_server.http + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["auth_required"] is True


def test_openai_client_with_and_without_the_key(auth_server):
    base = f"{auth_server.http}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=30)
    reply = good.completions.create(model="tiny", prompt="abc", max_tokens=3)
    assert reply.usage.completion_tokens >= 1


def test_websocket_key_by_header_or_subprotocol(auth_server):
    url = auth_server.ws
    assert _close_code(url) == 4401
    assert _close_code(url, headers={"Authorization": "Bearer wrong"}) == 4401
    assert _close_code(url, subprotocols=("specserve.v1", "bearer.wrong")) == 4401
    assert _close_code(url, headers={"Authorization": f"Bearer {KEY}"}) == 1000

    async def browser_style():
        async with WSConn(url, subprotocols=("specserve.v1", f"bearer.{KEY}")) as c:
            await c.roundtrip_ok()
            return c.ws.subprotocol

    assert run(browser_style()) == "specserve.v1"  # the key is never echoed back


def test_sdk_raises_authentication_error(auth_server):
    async def go(key):
        async with AsyncClient(auth_server.ws, api_key=key) as client:
            return await client.complete("abc", max_output_tokens=2).result()

    with pytest.raises(AuthenticationError):
        run(go("wrong"))
    with pytest.raises(AuthenticationError):
        run(go(None))
    assert run(go(KEY)).usage["output_tokens"] >= 1


def test_origin_allow_list(auth_server):
    from websockets.exceptions import InvalidStatus

    auth = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(InvalidStatus) as info:
        _close_code(auth_server.ws, headers=auth, origin="http://evil.example")
    assert info.value.response.status_code == 403
    assert _close_code(auth_server.ws, headers=auth, origin=GOOD_ORIGIN) == 1000
    same = f"http://127.0.0.1:{auth_server.port}"
    assert _close_code(auth_server.ws, headers=auth, origin=same) == 1000
    # HTTP too: a cross-site form post must not reach the engine.
    r = httpx.post(auth_server.http + "/v1/completions", timeout=10,
                   headers={**auth, "Origin": "http://evil.example"},
                   json={"model": "tiny", "prompt": "abc", "max_tokens": 2})
    assert r.status_code == 403
    r = httpx.get(auth_server.http + "/v1/models", timeout=10,
                  headers={**auth, "Origin": same})
    assert r.status_code == 200
