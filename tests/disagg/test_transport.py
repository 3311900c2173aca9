"""The TCP KV transport: blocks arrive bit-identical, each transfer is single use, a refused,
dropped or silent connection is an error, never a hang, a release frees a transfer nobody will
pull, and a server with a KV token refuses every request that does not prove it."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from specserve.disagg.protocol import (
    KVReply,
    KVTransferParams,
    TensorSpec,
    TransferMeta,
    encode_header,
)
from specserve.disagg.transport import KVPayload, TcpKVClient, TcpKVServer, TransferError

META = TransferMeta(num_prompt_tokens=37, first_token=5, block_size=16, num_draft_computed=0,
                    hidden_start=0)


class FakeSource:
    """Payloads by id; records releases."""

    def __init__(self, payloads: dict[str, KVPayload]) -> None:
        self.payloads = payloads
        self.released: list[str] = []

    def export(self, request_id: str) -> KVPayload:
        return self.payloads[request_id]

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.payloads.pop(request_id, None)

    def wait_released(self, timeout_s: float = 5.0) -> list[str]:
        """The server releases after its last send returns, which may be after the client has
        read everything: wait for it (bounded) instead of racing it."""
        deadline = time.monotonic() + timeout_s
        while not self.released and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.released


def params(server: TcpKVServer, request_id: str, engine_id: str | None = None):
    return KVTransferParams(remote_engine_id=engine_id or server.engine_id,
                            remote_block_ids=[], remote_host=server.host,
                            remote_port=server.port, remote_request_id=request_id)


@pytest.fixture
def served():
    def make(payloads, token=None):
        source = FakeSource(payloads)
        server = TcpKVServer(source, "engine-a", token=token)
        server.start()
        servers.append(server)
        return source, server
    servers: list[TcpKVServer] = []
    yield make
    for server in servers:
        server.stop()


@pytest.mark.parametrize("num_blocks", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_round_trip_bit_identical(served, num_blocks, dtype):
    gen = torch.Generator().manual_seed(num_blocks)
    kv = torch.randn(2, 2, num_blocks, 16, 2, 8, generator=gen).to(dtype)  # [L, 2, n, bs, H, D]
    kv[0, 0, 0, 0, 0, 0] = float("nan")  # bytes, not values: a NaN must survive too
    hidden = torch.randn(5, 64, generator=gen)
    state = torch.Generator().manual_seed(7).get_state()
    sent = KVPayload(META, {"target_kv": kv, "target_hidden": hidden, "generator": state,
                            "empty": torch.zeros(0, 64)})
    source, server = served({"r1": sent})
    got = TcpKVClient().pull(params(server, "r1"))
    assert got.meta == META
    assert list(got.tensors) == list(sent.tensors)
    for name, tensor in sent.tensors.items():
        assert got.tensors[name].dtype == tensor.dtype
        assert got.tensors[name].shape == tensor.shape
        assert torch.equal(got.tensors[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert source.wait_released() == ["r1"]


def test_a_transfer_is_single_use(served):
    state = torch.zeros(4, dtype=torch.uint8)
    source, server = served({"r1": KVPayload(META, {"generator": state})})
    TcpKVClient().pull(params(server, "r1"))
    with pytest.raises(TransferError, match="no prefilled KV waits under 'r1'"):
        TcpKVClient().pull(params(server, "r1"))


def test_wrong_engine_id_is_refused_and_keeps_the_blocks(served):
    source, server = served({"r1": KVPayload(META, {})})
    with pytest.raises(TransferError, match="engine id 'other' is not this server's"):
        TcpKVClient().pull(params(server, "r1", engine_id="other"))
    assert source.released == []  # the right decode server can still take them


def test_a_release_frees_the_transfer_at_once(served):
    source, server = served({"r1": KVPayload(META, {}), "r2": KVPayload(META, {})})
    TcpKVClient().release(params(server, "r1"))
    assert source.released == ["r1"]  # done when release returns: the server closed after it
    with pytest.raises(TransferError, match="no prefilled KV waits under 'r1'"):
        TcpKVClient().pull(params(server, "r1"))
    assert "r2" in source.payloads


def test_a_kv_token_is_required_once_the_server_has_one(served):
    source, server = served({"r1": KVPayload(META, {})}, token="s3cret")
    for client in (TcpKVClient(), TcpKVClient(token="guess")):
        with pytest.raises(TransferError, match="wrong or missing KV token"):
            client.pull(params(server, "r1"))
        client.release(params(server, "r1"))  # refused too: only the token holder frees
    assert source.released == []
    got = TcpKVClient(token="s3cret").pull(params(server, "r1"))
    assert got.meta == META and source.wait_released() == ["r1"]


def test_the_proof_is_bound_to_one_transfer_and_hides_the_token():
    from specserve.disagg.protocol import auth_ok, pull_auth

    proof = pull_auth("s3cret", "engine-a", "r1")
    assert "s3cret" not in proof and auth_ok("s3cret", "engine-a", "r1", proof)
    assert not auth_ok("s3cret", "engine-a", "r2", proof)
    assert not auth_ok("s3cret", "engine-b", "r1", proof)
    assert auth_ok(None, "engine-a", "r1", "")  # a server without a token checks nothing


def test_nobody_listening_is_an_error():
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = KVTransferParams(remote_engine_id="e", remote_block_ids=[], remote_host="127.0.0.1",
                         remote_port=port, remote_request_id="r")
    with pytest.raises(TransferError, match="failed"):
        TcpKVClient(timeout_s=2).pull(p)


def _one_shot_server(answer: bytes) -> tuple[int, threading.Thread]:
    """A server that reads the pull, sends `answer` and closes (or, if empty, stays silent)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        conn.recv(1024)
        if answer:
            conn.sendall(answer)
            conn.close()
        else:
            threading.Event().wait(3)
            conn.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def test_a_connection_dropped_mid_transfer_is_an_error():
    header = encode_header(KVReply(META, [TensorSpec("target_kv", "float32", [2, 2, 3, 16, 2, 8])]))
    port, thread = _one_shot_server(header + b"\0" * 1000)  # far fewer bytes than promised
    p = KVTransferParams(remote_engine_id="e", remote_block_ids=[], remote_host="127.0.0.1",
                         remote_port=port, remote_request_id="r")
    with pytest.raises(TransferError, match="closed the connection mid-frame"):
        TcpKVClient(timeout_s=5).pull(p)
    thread.join()


def test_a_silent_server_times_out():
    port, thread = _one_shot_server(b"")
    p = KVTransferParams(remote_engine_id="e", remote_block_ids=[], remote_host="127.0.0.1",
                         remote_port=port, remote_request_id="r")
    with pytest.raises(TransferError, match="timed out"):
        TcpKVClient(timeout_s=0.5).pull(p)
    thread.join()


def test_garbage_is_not_a_frame():
    port, thread = _one_shot_server(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    p = KVTransferParams(remote_engine_id="e", remote_block_ids=[], remote_host="127.0.0.1",
                         remote_port=port, remote_request_id="r")
    with pytest.raises(TransferError, match="not a specserve KV frame"):
        TcpKVClient(timeout_s=5).pull(p)
    thread.join()
