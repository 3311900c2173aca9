"""Disaggregated prefill, measured in one process: KV transfer cost, and the inter-token latency
of running chats while a long prompt arrives, colocated vs split.

    python -m bench disagg [--target PATH --draft PATH] [--sizes 256,1024,2048]
    python -m bench disagg --wire-only 30,3,64,576 --sizes 256,1024,2048

Two engines of the same model: a prefill engine (its `PrefillHandoff` behind a real
`TcpKVServer` on loopback) and a decode engine. The roles run one after the other, never side
by side, so neither takes CPU from the other: the model of two machines, with loopback TCP
standing in for the network. Transfer: prefill, pull (export + wire + receive), import (blocks
written), then the decode engine's first step (which, for an EAGLE-style draft, runs the
draft's catch-up over the whole prompt). Latency: `--chats` requests stream on the decode
engine; a long prompt arrives, computed there (colocated) or prefilled on the prefill engine and
imported (split); the gaps between the chats' tokens are read from the arrival until the long
request has 3 tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from specserve import LLM, SamplingParams
from specserve.disagg.handoff import PrefillHandoff, import_prefilled
from specserve.disagg.protocol import KVTransferParams, TransferMeta
from specserve.disagg.transport import KVPayload, TcpKVClient, TcpKVServer

GREEDY_1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


class Split:
    """The prefill engine, its held transfers behind TCP, and a client that pulls them."""

    def __init__(self, pre: LLM) -> None:
        core = pre.engine
        self.core = core
        self.handoff = PrefillHandoff(core, run_on_engine=lambda fn: fn(core))
        self.server = TcpKVServer(self.handoff, "measure")
        self.server.start()
        self.client = TcpKVClient()

    def prefill(self, prompt: list[int]):
        """(payload, prefill seconds, pull seconds)."""
        start = time.perf_counter()
        req = self.core.make_request(prompt, GREEDY_1)
        req.kv_hold = True
        self.core.add(req)
        while self.core.has_work:
            self.core.step()
        held = self.handoff.held(req.request_id)
        mid = time.perf_counter()
        payload = self.client.pull(KVTransferParams(
            remote_engine_id="measure", remote_block_ids=held.block_ids,
            remote_host=self.server.host, remote_port=self.server.port,
            remote_request_id=req.request_id))
        return payload, mid - start, time.perf_counter() - mid


def measure_transfer(split: Split, dec: LLM, sizes: list[int], vocab: int) -> None:
    core = dec.engine
    bs = core.block_manager.block_size
    print(f"{'tokens':>7} {'blocks':>6} {'MB':>7} {'prefill ms':>10} {'pull ms':>8} "
          f"{'us/token':>8} {'us/block':>8} {'GB/s':>6} {'import ms':>9} {'1st step ms':>11} "
          f"{'next step ms':>12}")
    for n in sizes:
        prompt = prompt_ids(n, vocab, n)
        split.prefill(prompt)  # warm: first touch of the pages, kernels at this size
        payload, t_prefill, t_pull = split.prefill(prompt + [7])
        req = core.make_request(prompt + [7], SamplingParams(temperature=0.0, max_tokens=3,
                                                              ignore_eos=True))
        start = time.perf_counter()
        import_prefilled(core, req, payload)
        t_import = time.perf_counter() - start
        steps = []
        while core.has_work:
            start = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - start)
        blocks = -(-(n + 1) // bs)
        mb = payload.nbytes / 1e6
        print(f"{n + 1:>7} {blocks:>6} {mb:>7.1f} {t_prefill * 1e3:>10.1f} {t_pull * 1e3:>8.1f} "
              f"{t_pull * 1e6 / (n + 1):>8.2f} {t_pull * 1e6 / blocks:>8.1f} "
              f"{mb / 1e3 / t_pull:>6.2f} {t_import * 1e3:>9.2f} {steps[0] * 1e3:>11.1f} "
              f"{statistics.median(steps[1:]) * 1e3 if steps[1:] else 0:>12.1f}")


def measure_wire(shape: str, sizes: list[int], block_size: int = 16) -> None:
    """Pulls of random tensors of a model's KV shape, no model run (`--wire-only`)."""
    layers, kv_heads, head_dim, hidden = (int(x) for x in shape.split(","))

    class Source:  # one payload at a time, under id "r"
        payload = None

        def export(self, request_id):
            return self.payload

        def release(self, request_id):
            pass

    source = Source()
    server = TcpKVServer(source, "wire")
    server.start()
    try:
        for n in sizes:
            blocks = -(-n // block_size)
            meta = TransferMeta(num_prompt_tokens=n, first_token=1, block_size=block_size,
                                num_draft_computed=0, hidden_start=0)
            source.payload = KVPayload(meta, {  # float32 KV, EAGLE draft's target rows
                "target_kv": torch.randn(layers, 2, blocks, block_size, kv_heads, head_dim),
                "target_hidden": torch.randn(n, hidden)})
            best = min(_timed_pull(server) for _ in range(5))
            mb = source.payload.nbytes / 1e6
            print(f"{n:>6} tokens {blocks:>4} blocks {mb:>6.1f} MB: pull {best * 1e3:6.1f} ms "
                  f"(best of 5), {best * 1e6 / n:6.1f} us/token, {best * 1e6 / blocks:7.1f} "
                  f"us/block, {mb / 1e3 / best:.2f} GB/s")
    finally:
        server.stop()


def _timed_pull(server: TcpKVServer) -> float:
    start = time.perf_counter()
    TcpKVClient().pull(KVTransferParams(remote_engine_id="wire", remote_block_ids=[],
                                        remote_host=server.host, remote_port=server.port,
                                        remote_request_id="r"))
    return time.perf_counter() - start


def chat_gaps(dec: LLM, split: Split | None, long_prompt: list[int], chats: int, vocab: int
              ) -> tuple[list[float], float]:
    """The chats' inter-token gaps (s) from the long prompt's arrival until it has 3 tokens,
    and the long prompt's time to first token."""
    core = dec.engine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    chat_ids = [core.add_request(prompt_ids(40, vocab, 100 + i), params).request_id
                for i in range(chats)]
    last: dict[str, float] = {}
    for _ in range(8):  # steady streaming first
        for delta in core.step():
            last[delta.request_id] = delta.time
    long_params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    arrival = time.monotonic()
    if split is None:
        long_id = core.add_request(long_prompt, long_params).request_id
        deltas = []
    else:  # the prefill engine's work runs elsewhere: the chats do not wait on it
        payload, t_prefill, t_pull = split.prefill(long_prompt)
        req = core.make_request(long_prompt, long_params)
        long_id = req.request_id
        arrival = time.monotonic() - t_prefill - t_pull  # when it arrived at the prefill side
        deltas = import_prefilled(core, req, payload)
        now = time.monotonic()
        for rid in chat_ids:  # on two machines the chats streamed on meanwhile: no gap here
            last[rid] = now
    gaps, ttft, got = [], None, 0
    while got < 3:
        for delta in deltas:
            if delta.request_id == long_id:
                got += len(delta.token_ids)
                ttft = ttft or delta.time - arrival
            elif delta.token_ids:
                gaps.append(delta.time - last[delta.request_id])
                last[delta.request_id] = delta.time
        deltas = core.step()
    for rid in chat_ids:
        core.abort(rid)
    return gaps, ttft


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--sizes", default="256,1024,2048")
    p.add_argument("--long", type=int, default=2048, help="the long prompt's tokens")
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--wire-only", metavar="L,HKV,D,H",
                   help="only pulls of random KV of this shape (layers, KV heads, head dim, "
                   "hidden size; SmolLM2-135M: 30,3,64,576), no model")
    args = p.parse_args(argv)
    if args.wire_only:
        measure_wire(args.wire_only, [int(s) for s in args.sizes.split(",")])
        return 0
    # No prefix caching: every prompt is computed, however often it repeats here.
    pre, dec = (LLM(args.target, args.draft, enable_prefix_caching=False) for _ in range(2))
    vocab = dec.engine.target.spec.vocab_size
    print(f"target {dec.engine.config.target.name}, draft "
          f"{dec.engine.config.draft.name if dec.engine.config.draft else None}, speculation "
          f"{dec.engine.default_mode}")
    split = Split(pre)
    try:
        measure_transfer(split, dec, [int(s) for s in args.sizes.split(",")], vocab)
        long_prompt = prompt_ids(args.long, vocab, 7)
        print(f"\n{args.chats} chats streaming, a {args.long}-token prompt arrives:")
        for name, side in (("colocated", None), ("split", split)):
            gaps, ttft = chat_gaps(dec, side, long_prompt, args.chats, vocab)
            print(f"{name:>10}: chat inter-token ms p50 {percentile(gaps, 0.5) * 1e3:.1f} "
                  f"p99 {percentile(gaps, 0.99) * 1e3:.1f} max {max(gaps) * 1e3:.1f} "
                  f"({len(gaps)} gaps); long prompt TTFT {ttft * 1e3:.0f} ms")
    finally:
        split.server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
