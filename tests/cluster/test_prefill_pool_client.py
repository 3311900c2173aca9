"""`PoolPrefillClient` over a fake deployment handle (the layer below): the answer becomes the
first token and `KVTransferParams`, a cancelled prefill cancels the call on its replica (whose
engine then frees the blocks), and a failed call is the request's clear error."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from specserve.cluster.prefill_pool import PoolPrefillClient  # noqa: E402
from specserve.disagg.decode import PrefillUnavailable  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402

ANSWER = {"request_id": "pf-1", "first_token": 42, "kv_transfer_params": {
    "remote_engine_id": "prefill-a", "remote_block_ids": [3, 4], "remote_host": "10.0.0.2",
    "remote_port": 5555, "remote_request_id": "pf-1"}}


class FakeResponse:
    """A `DeploymentResponse`: awaitable; answers, raises, or never answers."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome
        self.cancelled = False

    def __await__(self):
        return self._result().__await__()

    async def _result(self):
        if self.outcome is None:
            await asyncio.Event().wait()  # a prefill that takes forever
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, outcome) -> None:
        self.response = FakeResponse(outcome)
        self.calls = []

    @property
    def prefill(self):
        return self

    def remote(self, *args):
        self.calls.append(args)
        return self.response


PARAMS = SamplingParams(temperature=0.0, max_tokens=8, seed=3)


def test_the_answer_is_the_first_token_and_the_transfer():
    handle = FakeHandle(ANSWER)
    first, params = asyncio.run(PoolPrefillClient(handle).prefill([5, 6], PARAMS, "chain:3"))
    assert first == 42 and params.remote_block_ids == [3, 4] and params.remote_port == 5555
    ids, sampling, speculation = handle.calls[0]
    assert ids == [5, 6] and sampling["seed"] == 3 and "max_tokens" not in sampling
    assert speculation == "chain:3"


def test_a_cancelled_prefill_cancels_the_call_on_its_replica():
    handle = FakeHandle(None)

    async def go():
        task = asyncio.ensure_future(PoolPrefillClient(handle).prefill([5], PARAMS, None))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task

    assert asyncio.run(go()).cancelled() and handle.response.cancelled


def test_a_failed_call_is_a_clear_error():
    handle = FakeHandle(ValueError("prompt token ids out of range"))
    with pytest.raises(PrefillUnavailable, match="prefill pool failed: prompt token ids"):
        asyncio.run(PoolPrefillClient(handle).prefill([5], PARAMS, None))
