"""The messages of a KV transfer and how they are framed on a byte stream.

A frame is a fixed prefix (magic, version, header length), a small typed header encoded with
msgspec's MessagePack, then the raw bytes of the tensors the header lists, in order. The header
names each tensor's dtype and shape, so the receiver sizes every buffer before reading a byte
and reads straight into it; nothing is pickled, and a header that does not decode into one of
the message types below, or names a dtype or size out of bounds, is refused.

`KVTransferParams` follows the field names of vLLM's disaggregation protocol (the prefill
answer's `kv_transfer_params`), so an existing proxy can pass it from one side to the other.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct

import msgspec
import torch

MAGIC = b"SSKV"
VERSION = 1
_PREFIX = struct.Struct("!4sBI")  # magic, version, header length
MAX_HEADER_BYTES = 1 << 20
MAX_TENSOR_BYTES = 64 << 30

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "uint8": torch.uint8, "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ProtocolError(ConnectionError):
    """The peer sent something that is not a well-formed frame, or closed mid-frame."""


class KVTransferParams(msgspec.Struct, kw_only=True):
    """Where a prefilled prompt's KV waits: the prefill answer carries it, the decode side
    pulls with it. Field names as vLLM's connectors spell them."""

    remote_engine_id: str
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    remote_request_id: str  # the transfer's id on the prefill side (single use)
    do_remote_prefill: bool = True


class TensorSpec(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


class TransferMeta(msgspec.Struct, kw_only=True):
    """What the decode side needs besides the tensors to continue the request."""

    num_prompt_tokens: int
    first_token: int  # sampled by the prefill side from the prompt's last position
    block_size: int
    num_draft_computed: int  # prompt tokens whose draft KV came along ("draft_kv")
    hidden_start: int  # position of the first row of "target_hidden" (if sent)


class PullRequest(msgspec.Struct, tag="pull"):
    engine_id: str
    request_id: str
    auth: str = ""  # pull_auth(token, ...) when the servers share a --kv-token


class ReleaseRequest(msgspec.Struct, tag="release"):
    """The decode side gave up on a transfer (its client went away): free its blocks now
    instead of at the end of their time to live. The server frees them, then closes the
    connection without an answer (an `ErrorReply` if it refuses)."""

    engine_id: str
    request_id: str
    auth: str = ""


class KVReply(msgspec.Struct, tag="kv"):
    meta: TransferMeta
    tensors: list[TensorSpec]


class ErrorReply(msgspec.Struct, tag="error"):
    message: str


Message = PullRequest | ReleaseRequest | KVReply | ErrorReply


def pull_auth(token: str | None, engine_id: str, request_id: str) -> str:
    """Proof that the sender holds the shared KV token, bound to one transfer: an HMAC of the
    transfer's ids, so the token itself never crosses the wire and a captured proof opens
    nothing else (a transfer is single use)."""
    if not token:
        return ""
    message = f"{engine_id}/{request_id}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def auth_ok(token: str | None, engine_id: str, request_id: str, auth: str) -> bool:
    """Whether a request carries the proof `token` asks for (any request, without a token)."""
    return not token or hmac.compare_digest(pull_auth(token, engine_id, request_id), auth)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def tensor_spec(name: str, tensor: torch.Tensor) -> TensorSpec:
    if tensor.dtype not in _DTYPE_NAMES:
        raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which a transfer cannot "
                         f"carry ({', '.join(DTYPES)})")
    return TensorSpec(name, _DTYPE_NAMES[tensor.dtype], list(tensor.shape))


def encode_header(message: Message) -> bytes:
    body = _encoder.encode(message)
    return _PREFIX.pack(MAGIC, VERSION, len(body)) + body


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is already contiguous on the host."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def read_message(read_exact) -> Message:
    """One frame's header; `read_exact(n) -> bytes` reads exactly n bytes or raises."""
    magic, version, length = _PREFIX.unpack(read_exact(_PREFIX.size))
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a specserve KV frame (magic {magic!r}, version {version})")
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame header of {length} bytes is over {MAX_HEADER_BYTES}")
    try:
        message = _decoder.decode(read_exact(length))
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad frame header: {exc}") from exc
    if isinstance(message, KVReply):
        for spec in message.tensors:
            if spec.dtype not in DTYPES or any(d < 0 for d in spec.shape):
                raise ProtocolError(f"bad tensor spec {spec}")
        if sum(spec.nbytes for spec in message.tensors) > MAX_TENSOR_BYTES:
            raise ProtocolError("transfer larger than MAX_TENSOR_BYTES")
    return message


def empty_tensor(spec: TensorSpec) -> tuple[torch.Tensor, memoryview]:
    """A host tensor sized from its spec, and the writable bytes to receive it into."""
    raw = torch.empty(spec.nbytes, dtype=torch.uint8)
    return raw.view(DTYPES[spec.dtype]).view(spec.shape), memoryview(raw.numpy())
