"""Moving a prefilled prompt's KV from the prefill side to the decode side.

One small interface, two sides:
- the prefill side offers held transfers through a `KVSource` (`export` a transfer's tensors,
  then `release` its blocks, once, whether or not the send got through);
- the decode side calls `KVTransport.pull(params)` with the prefill answer's
  `KVTransferParams` and gets a `KVPayload` (the meta and host tensors), or an error.

`TcpKVServer` / `TcpKVClient` are the CPU backend: one TCP connection per transfer, one
`PullRequest` frame up, one `KVReply` frame (header + raw tensor bytes) down
(`protocol.py`). It works on one host and between hosts.

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
    TransferMeta,
    empty_tensor,
    encode_header,
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
                 advertise_host: str | None = None) -> None:
        self.source = source
        self.engine_id = engine_id
        self.timeout_s = timeout_s
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
                if not isinstance(message, PullRequest):
                    raise ProtocolError(f"expected a pull, got {type(message).__name__}")
                if message.engine_id != self.engine_id:
                    conn.sendall(encode_header(ErrorReply(
                        f"engine id {message.engine_id!r} is not this server's "
                        f"({self.engine_id!r})")))
                    return
                request_id = message.request_id
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


class TcpKVClient:
    """The decode side's pull over TCP."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def pull(self, params: KVTransferParams) -> KVPayload:
        where = f"{params.remote_host}:{params.remote_port}"
        try:
            with socket.create_connection((params.remote_host, params.remote_port),
                                          timeout=self.timeout_s) as sock:
                sock.sendall(encode_header(PullRequest(params.remote_engine_id,
                                                       params.remote_request_id)))
                return receive_payload(sock)
        except TimeoutError as exc:
            raise TransferError(f"KV transfer from {where} timed out after "
                                f"{self.timeout_s:g} s") from exc
        except (OSError, ProtocolError) as exc:
            raise TransferError(f"KV transfer from {where} failed: {exc}") from exc
