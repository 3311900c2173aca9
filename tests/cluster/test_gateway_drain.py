"""The gateway's drain on a real uvicorn (127.0.0.1) over fake replicas (test_gateway_engine's):
a second signal during the drain skips the waiting, yet the lifespan still shuts the engine
down (the replica's turn aborted, the handle stopped) and nothing logs a traceback."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from specserve.cluster.gateway_engine import ClusterEngine  # noqa: E402
from specserve.cluster.replica import EngineFacts  # noqa: E402
from specserve.cluster.router import PrefixAffinityRouter  # noqa: E402
from specserve.engine import EngineLimits, ModelInfo  # noqa: E402
from specserve.model.loader import load_tokenizer  # noqa: E402
from specserve.server import ServerLimits, create_app, uvicorn_config  # noqa: E402
from specserve.server.drain import DrainingServer  # noqa: E402
from specserve.speculation.modes import parse_speculation  # noqa: E402
from tests.cluster.conftest import free_port  # noqa: E402
from tests.cluster.test_gateway_engine import (  # noqa: E402
    HOLD,
    TOKEN,
    FakeEngine,
    FakeHandle,
    Replicas,
)
from tests.server.server_helpers import WSConn  # noqa: E402


def test_a_second_signal_during_the_drain_exits_quietly_and_still_shuts_down(tiny_target,
                                                                             capfd):
    async def go():
        replicas = Replicas()
        replica = FakeEngine([[5]], HOLD)
        await replicas.add("r0", replica)
        tokenizer = load_tokenizer(tiny_target)
        info = ModelInfo(Path(tiny_target), None, 320, parse_speculation("off", False))
        engine = ClusterEngine(FakeHandle(), EngineFacts(info, EngineLimits(256, 1024, 2),
                                                         tokenizer),
                               1, TOKEN, PrefixAffinityRouter(), live=lambda: replicas.live)
        app = create_app(engine, limits=ServerLimits.for_engine(engine))
        port = free_port()
        server = DrainingServer(uvicorn_config(app, "127.0.0.1", port, "warning"),
                                app.state.server.admission, drain_timeout=60)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        async with WSConn(f"ws://127.0.0.1:{port}/v1/ws") as conn:
            await conn.create("long", prompt="abc", max_output_tokens=100, ignore_eos=True)
            assert (await conn.recv())["type"] == "response.created"
            assert (await conn.recv())["type"] == "response.output_text.delta"
            server.handle_exit(signal.SIGTERM, None)  # the drain would wait up to 60 s
            await asyncio.sleep(0.3)
            server.handle_exit(signal.SIGTERM, None)  # no more waiting
            await asyncio.wait_for(serving, 10)
        assert engine.handle.shut_down and engine.num_in_flight() == 0
        for _ in range(100):
            if replica.aborted:
                break
            await asyncio.sleep(0.01)
        assert [rid.partition("/")[2] for rid in replica.aborted] == ["long"]
        await replicas.close()

    asyncio.run(go())
    err = capfd.readouterr().err
    assert "Traceback" not in err and "CancelledError" not in err, err
