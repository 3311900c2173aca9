"""Moving a prefilled prompt's KV from the prefill side to the decode side.

One small interface, two sides:
- the prefill side offers held transfers through a `KVSource` (`export` a transfer's tensors,
  then `release` its blocks, once, whether or not the send got through);
- the decode side calls `KVTransport.pull(params)` with the prefill answer's
  `KVTransferParams` and gets a `KVPayload` (the meta and host tensors), or an error; or
  `KVTransport.release(params)` when its client went away first.

`TcpKVServer` / `TcpKVClient` are the CPU backend: one TCP connection per transfer, one
`PullRequest` frame up, one `KVReply` frame (header + raw tensor bytes) down
(`protocol.py`), or a `ReleaseRequest` up when the decode side gives a transfer up. It works
on one host and between hosts. With a shared secret (`--kv-token`) each request carries an
HMAC of its transfer's ids under it, and a server started with the secret refuses any request
without the right one (an `ErrorReply` naming the token); without it, keep the port on a
private network.

A GPU backend (NIXL or NCCL) is designed for, not built: the prefill side registers its KV
pool's memory once and publishes the descriptors beside its engine id; `KVTransferParams`'
block ids are then the read descriptors, and the decode side's `pull` becomes a one-sided read
of those blocks straight into blocks it has allocated (no host staging), followed by the same
release notification. The payload's small parts (meta, hidden rows, generator state) would
still travel in a frame like this one.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .protocol import (
    ErrorReply,
    KVReply,
    KVTransferParams,
    ProtocolError,
    PullRequest,
    ReleaseRequest,
    TransferMeta,
    auth_ok,
    empty_tensor,
    encode_header,
    pull_auth,
    read_message,
    tensor_bytes,
    tensor_spec,
)

log = logging.getLogger("specserve.disagg")


class TransferError(RuntimeError):
    """A transfer failed: the prefill side refused it, or the connection broke or timed out."""


@dataclass
class KVPayload:
    """A prefilled prompt, as it travels. Tensors by name (see `handoff.py` for which)."""

    meta: TransferMeta
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class KVSource(Protocol):
    def export(self, request_id: str) -> KVPayload:
        """The held transfer's payload; KeyError if there is none by that id."""

    def release(self, request_id: str) -> None:
        """Free the transfer's blocks (it is single use); a no-op for an unknown id."""


class KVTransport(Protocol):
    def pull(self, params: KVTransferParams) -> KVPayload:
        """Fetch the transfer `params` names; TransferError on any failure."""

    def release(self, params: KVTransferParams) -> None:
        """Have the prefill side free a transfer this side will not pull (its client went
        away). Best effort: never raises (the time to live frees it otherwise)."""


def _read_exact(sock: socket.socket):
    def read(n: int) -> bytes:
        buf = bytearray(n)
        _recv_into(sock, memoryview(buf))
        return bytes(buf)
    return read


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view)
        if got == 0:
            raise ProtocolError("the peer closed the connection mid-frame")
        view = view[got:]


def send_payload(sock: socket.socket, payload: KVPayload) -> None:
    specs = [tensor_spec(name, t) for name, t in payload.tensors.items()]
    sock.sendall(encode_header(KVReply(payload.meta, specs)))
    for t in payload.tensors.values():
        if t.numel():
            sock.sendall(tensor_bytes(t))


def receive_payload(sock: socket.socket) -> KVPayload:
    message = read_message(_read_exact(sock))
    if isinstance(message, ErrorReply):
        raise TransferError(f"the prefill server refused the transfer: {message.message}")
    if not isinstance(message, KVReply):
        raise ProtocolError(f"expected a KV reply, got {type(message).__name__}")
    tensors = {}
    for spec in message.tensors:  # every buffer sized from the header before its bytes arrive
        tensor, view = empty_tensor(spec)
        _recv_into(sock, view)
        tensors[spec.name] = tensor
    return KVPayload(message.meta, tensors)


class TcpKVServer:
    """The prefill side's KV endpoint: a thread that accepts pulls and answers each on a thread
    of its own (a slow reader does not hold up the others)."""

    def __init__(self, source: KVSource, engine_id: str, host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 30.0,
                 advertise_host: str | None = None, token: str | None = None) -> None:
        self.source = source
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.token = token  # the shared --kv-token: every pull and release must prove it
        self._listener = socket.create_server((host, port))
        # Where decode servers connect (the bound address may be a wildcard).
        self.host, self.port = advertise_host or host, self._listener.getsockname()[1]
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="specserve-kv-server",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._listener.close()  # the accept loop's accept() raises and the loop ends
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="specserve-kv-send").start()

    def _serve(self, conn: socket.socket) -> None:
        request_id = None
        with conn:
            try:
                conn.settimeout(self.timeout_s)
                message = read_message(_read_exact(conn))
                if not isinstance(message, PullRequest | ReleaseRequest):
                    raise ProtocolError(f"expected a pull or a release, got "
                                        f"{type(message).__name__}")
                refusal = self._refusal(message)
                if refusal is not None:
                    log.warning("%s of %s refused: %s", type(message).__name__,
                                message.request_id, refusal)
                    conn.sendall(encode_header(ErrorReply(refusal)))
                    return
                request_id = message.request_id  # released below, whatever happens next
                if isinstance(message, ReleaseRequest):
                    return
                try:
                    payload = self.source.export(request_id)
                except KeyError:
                    conn.sendall(encode_header(ErrorReply(
                        f"no prefilled KV waits under {request_id!r} (already taken, expired "
                        f"or never made)")))
                    return
                except Exception as exc:  # a bug: the decode side gets its message, not EOF
                    log.exception("export of %s failed", request_id)
                    conn.sendall(encode_header(ErrorReply(f"export failed: {exc}")))
                    return
                send_payload(conn, payload)
            except (OSError, ProtocolError) as exc:
                log.warning("KV transfer %s failed: %s", request_id, exc)
            finally:
                if request_id is not None:
                    self.source.release(request_id)

    def _refusal(self, message: PullRequest | ReleaseRequest) -> str | None:
        """Why a request is refused, or None. A refused request releases nothing: only the
        holder of the token may free a transfer."""
        if message.engine_id != self.engine_id:
            return (f"engine id {message.engine_id!r} is not this server's "
                    f"({self.engine_id!r})")
        if not auth_ok(self.token, message.engine_id, message.request_id, message.auth):
            return ("wrong or missing KV token: this prefill server requires the --kv-token "
                    "it was started with, and the decode server's does not match")
        return None


class TcpKVClient:
    """The decode side's pull (and release) over TCP; `token` is the shared --kv-token."""

    def __init__(self, timeout_s: float = 30.0, token: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.token = token

    def _request(self, kind, params: KVTransferParams) -> bytes:
        rid, engine = params.remote_request_id, params.remote_engine_id
        return encode_header(kind(engine, rid, pull_auth(self.token, engine, rid)))

    def release(self, params: KVTransferParams) -> None:
        try:
            with socket.create_connection((params.remote_host, params.remote_port),
                                          timeout=self.timeout_s) as sock:
                sock.sendall(self._request(ReleaseRequest, params))
                sock.recv(1 << 12)  # the server's close (or its refusal): the release is done
        except OSError as exc:
            log.warning("release of KV transfer %s failed: %s", params.remote_request_id, exc)

    def pull(self, params: KVTransferParams) -> KVPayload:
        where = f"{params.remote_host}:{params.remote_port}"
        try:
            with socket.create_connection((params.remote_host, params.remote_port),
                                          timeout=self.timeout_s) as sock:
                sock.sendall(self._request(PullRequest, params))
                return receive_payload(sock)
        except TimeoutError as exc:
            raise TransferError(f"KV transfer from {where} timed out after "
                                f"{self.timeout_s:g} s") from exc
        except (OSError, ProtocolError) as exc:
            raise TransferError(f"KV transfer from {where} failed: {exc}") from exc
