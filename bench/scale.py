"""Scale-out on Ray Serve (issue 36): prefix-aware routing against round robin on 2 engine
replicas, what the gateway costs against the single-process server, and memory per replica.

    python -m bench scale [--target demo] [--conversations 16] [--turns 4] [--concurrency 4]
                          [--max-tokens 16] [--overhead-requests 60]
                          [--parts overhead,routing] [--json PATH]

One run, up to three parts (`--parts`: overhead, routing; memory comes with whichever runs);
Ray starts locally, and every engine runs on one torch thread:
- overhead: `specserve serve` in a child process and one engine replica behind the gateway
  (the gateway's starlette app in a child process, as `specserve serve --replicas` runs it ->
  the replica over its stream connection) are up at once and measured in alternating blocks
  over WebSocket, one request at a time: TTFT p50 and per-token time ((e2e - TTFT) /
  (tokens - 1)) of one short prompt, speculation off (one token per event), the engine's own
  TTFT (from its request's arrival to its first token: what the engine's process adds, apart
  from the path to it and back), and each serving process's CPU per request. The difference is
  what the hop to the replica and back costs.
- routing: a fresh 2-replica application per router (each starts with cold caches), the same
  workload on each: conversations sharing one system prompt, each a WebSocket session of
  `--turns` turns whose messages carry the whole history (canned assistant replies, so both
  routers get the same tokens), `--concurrency` conversations at a time. Reported: prefix-cache
  hit rate (cached prompt tokens / prompt tokens, from `response.done`), TTFT p50/p99, output
  tokens/s, requests per replica.
- memory: each replica's resident memory (the gateway's /health) beside the single server's.

What 2 cores can show: which router keeps the caches warm (the hit rate, and the prompt compute
it saves in TTFT), and the gateway's added latency per request and per token. What they cannot:
throughput growing with replicas (both replicas share the two cores with the gateway, Ray's
own processes and this client, so tokens/s cannot double), or hops between machines (all on
loopback).
A multi-machine run needs a replica per machine (`ray start --head`, `ray start --address`),
the client on a machine of its own, and enough conversations at once to load every replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from bench.options import add_json, environment, log, write_json
from bench.serve import BenchConfig, Chat, RequestRecord, WebSocketBackend, percentile

APP = "specserve"  # the application `specserve serve --replicas` runs (cluster/launch.py)
PARTS = ("overhead", "routing")
BLOCK = 10  # overhead samples alternate between the two servers in blocks of this many
SYSTEM = ("You are the support assistant of a company that sells and repairs bicycles. Answer "
          "in two sentences at most, name the part or the service the customer needs, give "
          "prices in euros, never promise a delivery date, and when a question is about safety "
          "tell the customer to stop riding and bring the bicycle to the nearest shop. Opening "
          "hours are nine to six on weekdays and ten to four on Saturdays; the shops are closed "
          "on Sundays and public holidays. Repairs under warranty are free within two years of "
          "purchase with the receipt; batteries of electric bicycles are covered for one year.")
WORDS = ("brake chain wheel tyre saddle pedal battery motor gear frame light bell spoke rim "
         "cable handlebar fork lock pump helmet").split()


@dataclass
class TurnRecord(RequestRecord):
    cached_tokens: int = 0  # prompt tokens the replica found in its prefix cache
    replica: str | None = None
    engine_ttft_s: float = 0.0  # the engine's own, from its arrival to its first token


class Backend(WebSocketBackend):
    """bench.serve's WebSocket client, also keeping what `response.done` says of the prefix
    cache and the replica."""

    @staticmethod
    def _finish(record: TurnRecord, done: dict, now: float) -> None:
        WebSocketBackend._finish(record, done, now)
        metrics = done.get("metrics") or {}
        record.cached_tokens = metrics.get("num_prefix_cached_tokens", 0)
        record.replica = metrics.get("replica")
        record.engine_ttft_s = metrics.get("ttft_ms", 0.0) / 1e3


def question(conversation: int, turn: int) -> str:
    """A question with a pasted order list: about as long as the system prompt's third, so a
    conversation's own history soon outweighs the shared prefix."""
    rng = random.Random(conversation * 1000 + turn)
    items = ", ".join(f"{rng.choice(WORDS)} {rng.randrange(100, 999)}" for _ in range(16))
    return f"Ticket {conversation}, question {turn}: my order lists {items}. Which one broke?"


def messages(conversation: int, turn: int) -> list[dict]:
    """The whole history of `turn` in `conversation`: the system prompt, earlier turns with
    canned replies, and the new question."""
    out = [{"role": "system", "content": SYSTEM}]
    for t in range(turn):
        out += [{"role": "user", "content": question(conversation, t)},
                {"role": "assistant", "content": f"Ticket {conversation}: item {t} is noted, "
                                                 f"bring the bicycle to the shop."}]
    return out + [{"role": "user", "content": question(conversation, turn)}]


async def run_request(backend: Backend, record: TurnRecord, chat: Chat) -> TurnRecord:
    await asyncio.wait_for(backend.request(record, chat), 300)
    if not record.ok:
        raise RuntimeError(f"request {record.index} failed: {record.error}")
    return record


# ---- routing ------------------------------------------------------------------------------
async def workload(url: str, args: argparse.Namespace) -> tuple[list[TurnRecord], float]:
    config = BenchConfig(url=url, max_tokens=args.max_tokens, ignore_eos=True,
                         speculation=args.speculation)
    gate = asyncio.Semaphore(args.concurrency)

    async def conversation(c: int) -> list[TurnRecord]:
        async with gate:
            backend = Backend(config)  # one socket: the conversation's session
            try:
                return [await run_request(backend, TurnRecord(c * args.turns + t, c),
                                          Chat(messages(c, t)))
                        for t in range(args.turns)]
            finally:
                await backend.close()

    start = time.perf_counter()
    done = await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return [r for records in done for r in records], time.perf_counter() - start


def routing_summary(records: list[TurnRecord], wall_s: float) -> dict:
    ttft = sorted(r.ttft_s * 1e3 for r in records)
    replicas: dict[str, int] = {}
    for r in records:
        replicas[r.replica] = replicas.get(r.replica, 0) + 1
    return {"requests": len(records),
            "prefix_hit_rate": sum(r.cached_tokens for r in records)
            / sum(r.input_tokens for r in records),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "output_tokens_per_s": sum(r.output_tokens for r in records) / wall_s,
            "wall_s": wall_s, "requests_per_replica": sorted(replicas.values())}


# ---- overhead -----------------------------------------------------------------------------
async def overhead(servers: dict[str, tuple[str, dict[str, int]]],
                   args: argparse.Namespace) -> dict:
    """`servers`: name -> (WebSocket URL, the processes that serve it, by role). Besides
    latency, the CPU time each process spends per request, less what it spends idle (Ray's
    processes poll and report even then): on a machine with cores to spare the gateway's work
    overlaps the engine's, so the CPU it costs is the figure that carries over; on 2 busy
    cores it also shows up as latency."""
    config = BenchConfig(max_tokens=args.max_tokens, ignore_eos=True, speculation="off")
    chat = Chat([{"role": "user", "content": "Which tyre fits my city bicycle?"}])
    backends = {name: Backend(replace(config, url=url)) for name, (url, _) in servers.items()}
    samples: dict[str, list[TurnRecord]] = {name: [] for name in servers}
    busy = {name: dict.fromkeys(pids, 0.0) for name, (_, pids) in servers.items()}
    busy_s = dict.fromkeys(servers, 0.0)
    try:
        for backend in backends.values():  # warm-up: first touches, socket open
            for i in range(3):
                await run_request(backend, TurnRecord(i, 0), chat)
        idle = await idle_cpu_rates({name: pids for name, (_, pids) in servers.items()})
        for block in range(max(1, args.overhead_requests // BLOCK)):
            for name, backend in backends.items():
                pids = servers[name][1]
                before, start = cpu_seconds(pids), time.perf_counter()
                for i in range(BLOCK):
                    samples[name].append(await run_request(backend, TurnRecord(i, block), chat))
                busy_s[name] += time.perf_counter() - start
                for role, spent in cpu_seconds(pids).items():
                    busy[name][role] += spent - before[role]
    finally:
        for backend in backends.values():
            await backend.close()
    out = {}
    for name, records in samples.items():
        cpu_ms = {role: max(0.0, spent - idle[name][role] * busy_s[name]) * 1e3 / len(records)
                  for role, spent in busy[name].items()}
        out[name] = {"ttft_ms_p50": statistics.median(r.ttft_s * 1e3 for r in records),
                     "engine_ttft_ms_p50": statistics.median(r.engine_ttft_s * 1e3
                                                             for r in records),
                     "per_token_ms_p50": statistics.median(r.tpot_s * 1e3 for r in records),
                     "cpu_ms_per_request": sum(cpu_ms.values()),
                     "cpu_ms_per_request_by_process": cpu_ms,
                     "output_tokens_per_request": records[0].output_tokens,
                     "samples": len(records)}
    return out


async def idle_cpu_rates(groups: dict[str, dict[str, int]], seconds: float = 3.0) -> dict:
    """CPU seconds per second each process spends while no request runs."""
    before = {name: cpu_seconds(pids) for name, pids in groups.items()}
    await asyncio.sleep(seconds)
    return {name: {role: (spent - before[name][role]) / seconds
                   for role, spent in cpu_seconds(pids).items()}
            for name, pids in groups.items()}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU time of each process (all its threads) so far, by role."""
    out = {}
    for role, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[role] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return out


def serve_processes(gateway: subprocess.Popen) -> dict[str, int]:
    """The processes of a 1-replica application, by role: the engine replica (Ray names its
    process after its actor) and the gateway process."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and f"ServeReplica:{APP}:engine" in cmdline:
            found.append(int(proc.name))
    if len(found) != 1:
        raise RuntimeError(f"expected one engine replica process, found {found}")
    return {"engine": found[0], "gateway": gateway.pid}


# ---- servers ------------------------------------------------------------------------------
def wait_healthy(http: str, deadline: float, replicas: int | None = None,
                 proc: subprocess.Popen | None = None) -> dict:
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{http}'s process exited {proc.returncode}")
        try:
            response = httpx.get(f"{http}/health", timeout=5)
            body = response.json()
            if response.status_code == 200 and (replicas is None
                                                or body.get("replicas_healthy") == replicas):
                return body
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{http} not healthy in time")
        time.sleep(0.3)


def single_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specserve", "serve", "--target", args.target_path,
           "--draft", args.draft_path, "--port", str(port), "--log-level", "warning"]
    if args.speculation:
        cmd += ["--speculation", args.speculation]
    with log_path.open("w") as err:  # a file: a chatty server can never block on a pipe
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})


def resident_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Gateway:
    """`replicas` engine replicas and their gateway, started as `specserve serve --replicas`
    starts them (cluster/launch.py's serve_forever) in a child process that joins this
    benchmark's Ray cluster; `stop` drains and deletes them as SIGTERM does."""

    def __init__(self, args: argparse.Namespace, address: str, port: int, replicas: int,
                 routing: str) -> None:
        spec = {"address": address, "port": port, "replicas": replicas, "routing": routing,
                "engine_options": {"target": args.target_path, "draft": args.draft_path,
                                   "speculation": args.speculation}}
        self.http = f"http://127.0.0.1:{port}"
        self.log = Path(f"/tmp/bench-scale-gateway-{port}.log")
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from bench.scale import gateway_main; "
                 "sys.exit(gateway_main(sys.argv[1]))", json.dumps(spec)],
                stdout=subprocess.DEVNULL, stderr=err)
        self.health = wait_healthy(self.http, time.monotonic() + 180, replicas, self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        if self.proc.wait(60) != 0:
            raise RuntimeError(f"the gateway exited {self.proc.returncode}: see {self.log}")


def gateway_main(spec: str) -> int:
    """The gateway process of `Gateway`: the benchmark's options for `serve_forever`."""
    from specserve.cluster import ClusterOptions
    from specserve.cluster.launch import serve_forever

    spec = json.loads(spec)
    options = ClusterOptions(
        engine_options=spec["engine_options"], num_replicas=spec["replicas"],
        app_options={"model_name": "bench"}, routing=spec["routing"], cpus_per_replica=1.0,
        stats_period_s=0.5, drain_timeout_s=2)
    return serve_forever(options, "127.0.0.1", spec["port"], spec["address"], "warning")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--target", default="demo", help="a model folder, or demo (default)")
    p.add_argument("--draft", help="default: the target's shipped draft")
    p.add_argument("--speculation", help="the engines' default mode (default: theirs)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="conversations at a time")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--overhead-requests", type=int, default=60,
                   help="requests per server in the overhead part")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"which parts to run, comma-separated (default: {','.join(PARTS)})")
    add_json(p)
    args = p.parse_args(argv)
    args.parts = [part for part in args.parts.split(",") if part]
    if not args.parts or any(part not in PARTS for part in args.parts):
        p.error(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, "
                f"got {','.join(args.parts)!r}")
    from specserve.named_models import resolve_models

    target, draft = resolve_models(args.target, args.draft)
    args.target_path = str(target.resolve())
    args.draft_path = str(draft.resolve()) if draft else None
    if args.draft_path is None:
        p.error("the scale benchmark runs a target with its draft (--draft)")

    import ray

    single_port, gateway_port = free_port(), free_port()
    log_path = Path(f"/tmp/bench-scale-single-{single_port}.log")
    # Started even without the overhead part: it only loads while Ray starts.
    single = single_server(args, single_port, log_path)
    os.environ["OMP_NUM_THREADS"] = "1"  # the replicas inherit it: one torch thread each
    result: dict = {"environment": environment(1), "args": {
        k: v for k, v in vars(args).items() if k not in ("json",)}}
    address = ray.init(num_cpus=2, include_dashboard=False,
                       log_to_driver=False).address_info["address"]
    gateway = None
    try:
        result["memory_bytes"] = {}
        if "overhead" in args.parts:
            wait_healthy(f"http://127.0.0.1:{single_port}", time.monotonic() + 120)
            gateway = Gateway(args, address, gateway_port, 1, "prefix")
            log("overhead: single-process server against one replica behind the gateway")
            result["overhead"] = asyncio.run(overhead(
                {"single": (f"ws://127.0.0.1:{single_port}", {"server": single.pid}),
                 "gateway": (f"ws://127.0.0.1:{gateway_port}", serve_processes(gateway.proc))},
                args))
            result["memory_bytes"]["single_server"] = resident_bytes(single.pid)
            result["memory_bytes"]["gateway"] = resident_bytes(gateway.proc.pid)
            gateway.stop()
        single.terminate()
        if "routing" in args.parts:
            result["routing"] = {}
            for routing in ("prefix", "round_robin"):
                gateway = Gateway(args, address, gateway_port, 2, routing)
                log(f"routing: {routing}, {args.conversations} conversations x {args.turns} "
                    f"turns")
                records, wall = asyncio.run(workload(f"ws://127.0.0.1:{gateway_port}", args))
                result["routing"][routing] = routing_summary(records, wall)
                health = wait_healthy(gateway.http, time.monotonic() + 30, 2)
                result["memory_bytes"][f"replicas_{routing}"] = sorted(
                    r["memory_bytes"] for r in health["replicas"])
                gateway.stop()
        result["load_average_after"] = os.getloadavg()
    finally:
        for proc in (single, gateway.proc if gateway is not None else None):
            if proc is not None and proc.poll() is None:
                proc.kill()
        ray.shutdown()
    print(report(result))
    write_json(args, result)
    return 0


def report(result: dict) -> str:
    env = result["environment"]
    after = result["load_average_after"][0]
    lines = [f"CPU {env['cpu']['model_name']} (family {env['cpu']['family']} model "
             f"{env['cpu']['model']}), {env['cpus']} cores, load {env['load_average'][0]:.2f} "
             f"before, {after:.2f} after"]
    if "overhead" in result:
        lines += ["", "overhead (WebSocket, one request at a time, speculation off):"]
        o = result["overhead"]
        for name in ("single", "gateway"):
            m = o[name]
            lines.append(f"  {name:<8} TTFT p50 {m['ttft_ms_p50']:7.2f} ms (engine's own "
                         f"{m['engine_ttft_ms_p50']:6.2f})   per token p50 "
                         f"{m['per_token_ms_p50']:6.3f} ms   CPU "
                         f"{m['cpu_ms_per_request']:6.1f} ms per request of "
                         f"{m['output_tokens_per_request']} tokens   (n={m['samples']})")
        added_ttft = o["gateway"]["ttft_ms_p50"] - o["single"]["ttft_ms_p50"]
        added_token = o["gateway"]["per_token_ms_p50"] - o["single"]["per_token_ms_p50"]
        added_cpu = o["gateway"]["cpu_ms_per_request"] - o["single"]["cpu_ms_per_request"]
        lines.append(f"  gateway adds {added_ttft:.2f} ms TTFT p50, {added_token:.3f} ms per "
                     f"token, {added_cpu:.1f} ms CPU per request (by process: " + ", ".join(
                         f"{role} {ms:.1f}" for role, ms
                         in o["gateway"]["cpu_ms_per_request_by_process"].items()) + ")")
    if "routing" in result:
        lines += ["", "routing, 2 replicas:",
                  f"  {'router':<12} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
                  f"{'tok/s':>7} {'requests per replica':>21}"]
        for name, r in result["routing"].items():
            lines.append(f"  {name:<12} {r['prefix_hit_rate']:8.1%} {r['ttft_ms_p50']:7.1f}ms "
                         f"{r['ttft_ms_p99']:7.1f}ms {r['output_tokens_per_s']:7.1f} "
                         f"{str(r['requests_per_replica']):>21}")
    mem = result["memory_bytes"]
    if "single_server" in mem:
        lines += ["", f"memory: single server {mem['single_server'] / 2**20:.0f} MiB, gateway "
                  f"process {mem['gateway'] / 2**20:.0f} MiB"]
    if "replicas_prefix" in mem:
        lines += ["memory: replicas " + ", ".join(
            f"{b / 2**20:.0f}" for b in mem["replicas_prefix"]) + " MiB"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
