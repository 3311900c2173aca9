"""`specserve serve --role prefill|decode|both`: the flags, and the engine and routes of each.

- both (the default): today's colocated server.
- prefill: a full server that also answers `POST /v1/disagg/prefill` and serves the KV of the
  prompts it prefilled on a TCP port (`--kv-port`, default: any free one; the answer names it).
- decode: a full server whose new requests are prefilled on `--prefill-url URL` (repeatable);
  clients talk to it as to any server.

With `--replicas N`, `--prefill-replicas M` runs the two roles as pools on Ray Serve
(specserve.cluster.prefill_pool). `--kv-token SECRET` (or $SPECSERVE_KV_TOKEN) on both: the
prefill server's KV port refuses pulls and releases that do not prove the shared secret
(`protocol.pull_auth`).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module for its flags: --help stays instant
    from ..engine import AsyncEngine
    from ..engine.core import EngineCore

ROLES = ("both", "prefill", "decode")
KV_TOKEN_ENV = "SPECSERVE_KV_TOKEN"


def add_role_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=ROLES, default="both",
                   help="both: prefill and decode here (default); prefill: also prefill "
                   "prompts for decode servers; decode: prefill every new prompt on "
                   "--prefill-url and decode here")
    p.add_argument("--prefill-url", action="append", default=[], metavar="URL",
                   help="with --role decode: a prefill server (repeatable; tried in turn)")
    p.add_argument("--kv-port", type=int, default=0, metavar="PORT",
                   help="with --role prefill: the TCP port decode servers pull KV from "
                   "(default: any free one)")
    p.add_argument("--prefill-timeout", type=float, default=120.0, metavar="S",
                   help="with --role decode: seconds a prefill may take before the request "
                   "fails (default: 120)")
    p.add_argument("--prefill-replicas", type=int, default=0, metavar="M",
                   help="with --replicas N: M more replicas prefill every prompt and the N "
                   "decode only, the KV moved between them by blocks (default: 0, each "
                   "replica does both)")
    p.add_argument("--kv-token", default=os.environ.get(KV_TOKEN_ENV), metavar="SECRET",
                   help="with --role prefill/decode: a secret both sides share; the prefill "
                   "server refuses KV pulls that do not prove it (default: $"
                   f"{KV_TOKEN_ENV}, which keeps it off the command line; none: no check)")


def check_role_options(args: argparse.Namespace) -> None:
    """ValueError naming a bad combination of flags (checked before any model loads)."""
    if args.prefill_url and args.role != "decode":
        raise ValueError("--prefill-url is for --role decode")
    if args.role == "decode" and not args.prefill_url:
        raise ValueError("--role decode needs --prefill-url URL")
    if args.role != "both" and (args.tp != 1 or getattr(args, "replicas", None) is not None):
        raise ValueError("--role prefill/decode does not run with --tp or --replicas yet "
                         "(with --replicas, use --prefill-replicas M)")
    if args.prefill_replicas and getattr(args, "replicas", None) is None:
        raise ValueError("--prefill-replicas is for --replicas N")


def role_engine(core: EngineCore, args: argparse.Namespace) -> AsyncEngine:
    """The engine of `args.role`; ValueError names a bad combination of flags."""
    check_role_options(args)
    if args.role == "prefill":
        from .prefill import PrefillEngine

        engine = PrefillEngine(core, args.host, args.kv_port, advertised_host(args.host),
                               kv_token=args.kv_token)
        print(f"specserve: prefill role; decode servers pull KV from "
              f"{engine.kv_server.host}:{engine.kv_server.port}"
              f"{' (KV token required)' if args.kv_token else ''}", file=sys.stderr, flush=True)
        return engine
    if args.role == "decode":
        from .decode import DecodeEngine, PrefillClient
        from .transport import TcpKVClient

        print(f"specserve: decode role; prompts prefilled on {', '.join(args.prefill_url)}",
              file=sys.stderr, flush=True)
        return DecodeEngine(core, PrefillClient(args.prefill_url, args.api_key,
                                                args.prefill_timeout),
                            TcpKVClient(token=args.kv_token))
    from ..engine import AsyncEngine

    return AsyncEngine(core)


def role_routes(engine: AsyncEngine) -> list:
    """Routes a role adds to the app."""
    from .prefill import ROUTES, PrefillEngine

    return ROUTES if isinstance(engine, PrefillEngine) else []


def advertised_host(bind_host: str) -> str:
    """The host decode servers connect to for KV: the bound one, or this machine's name when
    bound to every interface."""
    return socket.gethostname() if bind_host in ("0.0.0.0", "::", "") else bind_host
