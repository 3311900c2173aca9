"""The `specserve` command: `serve`, `generate`, `chat`.

    specserve serve [--target DIR] [--draft DIR] [--speculation S] [--port 8000] [--api-key K]
    specserve generate --prompt TEXT [--target DIR] [--max-tokens N] [--speculation S]
    specserve chat [--url ws://127.0.0.1:8000] [--api-key K]

Each subcommand is a pair of functions, `add_<name>(subparsers)` and `run_<name>(args)`, listed
in `SUBCOMMANDS`; heavy imports (torch, uvicorn) happen inside the `run_` functions so `--help`
is instant. Load tests are not part of the installed program: `python -m bench.serve` from the
repository root runs them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model folder (default: the bundled demo pair)")
    p.add_argument("--draft", help="draft model folder (default: the demo draft with the "
                   "demo target, none otherwise)")
    p.add_argument("--speculation", help="off | chain:K | tree | tree:N | static:NAME | "
                   "ngram:K | adaptive (default: the best mode for what is loaded)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--quantization", help="weight-only quantization of the target: int8 | int4 "
                   "(default: none)")
    p.add_argument("--draft-quantization", help="the draft's: int8 | int4 | none (default: the "
                   "target's)")


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(target=args.target, draft=args.draft, speculation=args.speculation,  # noqa: C408
                dtype=args.dtype, device=args.device, quantization=args.quantization,
                draft_quantization=args.draft_quantization)


# ---- serve --------------------------------------------------------------------------------
def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the chat server (WebSocket + OpenAI-compatible HTTP)")
    _add_model_options(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="require this key on every route but /health and the chat page "
                   "(default: $SPECSERVE_API_KEY; none: open)")
    p.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin allowed besides the server's own (repeatable; "
                   "'*' allows any)")
    p.add_argument("--model-name", help="the model id clients see (default: from --target)")
    p.add_argument("--max-queued-requests", type=int, default=64, metavar="N",
                   help="requests held beyond the engine's batch; past it HTTP 429 and "
                   "WebSocket 'overloaded' (default: 64)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, metavar="N",
                   help="largest HTTP request body; 413 past it (default: 4 MiB)")
    p.add_argument("--allowed-hosts", default="", metavar="H,...",
                   help="Host header names served besides the loopback names and --host "
                   "('*': any; default with a wildcard --host: any)")
    p.add_argument("--drain-timeout", type=float, default=20.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds in-flight streams may run on before they "
                   "are ended (default: 20; a second signal exits at once)")
    p.add_argument("--log-level", default="info")


def run_serve(args: argparse.Namespace) -> int:
    from .engine import AsyncEngine
    from .engine.core import EngineCore
    from .llm import build_engine_config
    from .server import ServerLimits, create_app, uvicorn_config
    from .server.drain import DrainingServer
    from .server.hosts import default_allowed_hosts

    try:
        core = EngineCore(build_engine_config(**_engine_options(args)))
    except (FileNotFoundError, ValueError) as exc:  # no demo pair yet, bad folder or option
        print(f"specserve serve: {exc}", file=sys.stderr)
        return 2
    engine = AsyncEngine(core)
    limits = ServerLimits.for_engine(engine, max_queued_requests=args.max_queued_requests,
                                     max_request_bytes=args.max_request_bytes)
    hosts = default_allowed_hosts(args.host, args.allowed_hosts.split(","))
    app = create_app(engine, api_key=args.api_key, allowed_origins=args.allowed_origin,
                     model_name=args.model_name, limits=limits, allowed_hosts=hosts)
    config = uvicorn_config(app, args.host, args.port, args.log_level)
    print(f"specserve: serving {app.state.server.model_name} "
          f"(speculation {core.default_mode}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    if hosts is None:
        print("specserve: any Host header is accepted; name the served hosts with "
              "--allowed-hosts", file=sys.stderr, flush=True)
    DrainingServer(config, app.state.server.admission, args.drain_timeout).run()
    return 0


# ---- generate -----------------------------------------------------------------------------
def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt offline and print the text")
    _add_model_options(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--seed", type=int)
    p.add_argument("--stats", action="store_true", help="print the request metrics to stderr")


def run_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling import SamplingParams

    try:
        llm = LLM(**_engine_options(args))
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                seed=args.seed)
    except (FileNotFoundError, ValueError) as exc:
        print(f"specserve generate: {exc}", file=sys.stderr)
        return 2
    out = llm.generate(args.prompt, params)[0]
    print(out.text)
    if args.stats:
        m = out.metrics
        print(f"[{len(out.token_ids)} tokens, finish {out.finish_reason}, acceptance length "
              f"{m['acceptance_length']:.2f}, e2e {m['e2e_s'] * 1e3:.0f} ms]", file=sys.stderr)
    return 0


# ---- chat ---------------------------------------------------------------------------------
def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal with a running server")
    p.add_argument("--url", default="ws://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"))
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--speculation")
    p.add_argument("--quiet", action="store_true", help="no per-reply statistics line")


def run_chat(args: argparse.Namespace, input_fn: Callable[[str], str] = input) -> int:
    from .client import Client, SpecserveError

    try:
        client = Client(args.url, api_key=args.api_key)
    except (SpecserveError, OSError) as exc:
        print(f"specserve chat: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1
    out = sys.stdout
    history = [{"role": "system", "content": args.system}] if args.system else []
    print(f"connected to {client.session.get('model')} (speculation "
          f"{client.session.get('speculation')}); /reset clears history, Ctrl-C stops a "
          f"reply, Ctrl-D quits", file=sys.stderr)
    with client:
        while True:
            try:
                line = input_fn("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if not line.strip():
                continue
            if line.strip() in ("/reset", "/clear"):
                history = history[:1] if args.system else []
                continue
            if line.strip() in ("/quit", "/exit"):
                return 0
            history.append({"role": "user", "content": line})
            stream = client.chat(history, temperature=args.temperature,
                                 max_output_tokens=args.max_tokens,
                                 speculation=args.speculation)
            try:
                for text in stream:
                    out.write(text)
                    out.flush()
            except KeyboardInterrupt:
                stream.cancel()
                stream.result()  # wait for response.done so the request is really gone
            except SpecserveError as exc:
                print(f"\n[error: {exc}]", file=sys.stderr)
                history.pop()
                continue
            out.write("\n")
            history.append({"role": "assistant", "content": stream.text})
            if not args.quiet and stream.metrics:
                m = stream.metrics
                print(f"[{stream.usage.get('output_tokens', 0)} tokens, {stream.status}, "
                      f"ttft {m['ttft_ms']:.0f} ms, {m['tokens_per_s']:.1f} tok/s, "
                      f"acceptance length {m['acceptance_length']:.2f}]", file=sys.stderr)


# ---- the program --------------------------------------------------------------------------
# (add_parser, run) per subcommand.
SUBCOMMANDS: dict[str, tuple[Callable, Callable]] = {
    "serve": (add_serve, run_serve),
    "generate": (add_generate, run_generate),
    "chat": (add_chat, run_chat),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add, _ in SUBCOMMANDS.values():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
