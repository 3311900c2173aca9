"""Prefix-aware routing: send a turn to the replica whose prefix cache most likely holds its
prompt, unless that replica's queue is clearly longer than the least-loaded one's.

The gateway routes each turn itself (`ClusterEngine`, then `channel.py` streams it): Ray Serve
supplies the live replicas (`ReplicaSet`, the deployment's request router, which Serve builds
inside the gateway's deployment handle and keeps current), and the policies below pick one.
A replica's queue is the number of turns this gateway has in flight there: exact with one
gateway, and known without a round trip.

`PrefixAffinityRouter` keeps, per replica, the chained hashes of the full KV blocks of the
prompts it sent there: the same block-granular keys the engine's prefix cache uses, so a match
of k blocks means the replica computed those k blocks recently. Like SGLang's cache-aware
router and Ray's PrefixCacheAffinityRouter, this is the router's own record, not a query of
the replica, so it costs no round trip; each record is bounded (least recently used blocks go
first), as the replica's cache is. Ray's PrefixCacheAffinityRouter is not used: it matches
characters of a `.prompt`/`.messages` argument through a separate actor with a blocking call
per request, and it has no conversation stickiness.

Order of preference for one request:
1. its conversation's replica (`Turn.session`), while that replica is alive and not full;
2. the replica with the longest block match, when the match covers at least
   `min_match_fraction` of the prompt (a shared chat template alone should not pull every
   request to one replica) and its queue exceeds the shortest queue by at most
   `imbalance_threshold` requests;
3. the shortest queue (a random one of equals).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from . import registry
from .channel import Turn

BLOCK_SIZE = 16  # tokens per KV block: the engine's default block size


def block_hashes(token_ids: list[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """Chained hashes of the prompt's full blocks: block i's key covers tokens [0, (i+1)*bs),
    so equal keys mean equal prefixes."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class ReplicaBlocks:
    """The block keys one replica was sent, least recently used first, at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt this replica holds."""
        n = 0
        for key in hashes:
            if key not in self.keys:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for key in hashes:
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


@dataclass(frozen=True)
class LiveReplica:
    """A running replica as the gateway sees it."""

    replica_id: str  # Serve's full id
    host: str  # its stream port's address (channel.py)
    port: int
    capacity: int  # its max_ongoing_requests: turns beyond it wait for another replica
    report: dict  # its last `record_routing_stats` report; empty before the first


class ReplicaSet(RequestRouter):
    """The request router of a deployment (the engine replicas, the prefill pool): Serve keeps
    its replicas current in the gateway's process, and it registers itself there under its
    deployment's name so the gateway reads them (`live`, `reports`). Serve routes only calls
    of the handle's own through it (the engine's `facts`, a decode replica's prefills), to
    the least-loaded replica; turns go over `channel.py`."""

    def initialize_state(self, deployment: str) -> None:
        registry.register(deployment, self)

    def reports(self) -> dict[str, dict]:
        """Each running replica's last `record_routing_stats` report, by id (once it came)."""
        return {rid.to_full_id_str(): replica.routing_stats
                for rid, replica in dict(self.curr_replicas).items() if replica.routing_stats}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        return [candidate_replicas]

    def live(self) -> list[LiveReplica]:
        """Each running replica that named its stream port, by id."""
        # A copy first: the router's loop thread may change the replicas while the gateway
        # reads.
        out = []
        for rid, replica in sorted(dict(self.curr_replicas).items(), key=lambda kv: str(kv[0])):
            meta = replica.replica_metadata
            if "stream_port" in meta:
                out.append(LiveReplica(rid.to_full_id_str(), meta["stream_host"],
                                       meta["stream_port"], replica.max_ongoing_requests,
                                       replica.routing_stats or {}))
        return out


@dataclass(frozen=True)
class Candidate:
    """A replica a turn may go to, with this gateway's turns in flight there (its queue)."""

    replica_id: str
    queue: int
    capacity: int

    @property
    def has_room(self) -> bool:
        return self.queue < self.capacity


class RoutingPolicy(Protocol):
    """What the gateway asks of a routing policy."""

    def choose(self, turn: Turn, candidates: list[Candidate]) -> Candidate:
        """The replica for `turn` among `candidates` (at least one)."""

    def routed(self, turn: Turn, replica_id: str) -> None:
        """`turn` went to `replica_id`."""

    def forget(self, replica_id: str) -> None:
        """The replica is gone."""


def shortest(candidates: list[Candidate]) -> Candidate:
    """The least-loaded candidate, preferring one with room; a random one of equals."""
    pool = [c for c in candidates if c.has_room] or candidates
    least = min(c.queue for c in pool)
    return random.choice([c for c in pool if c.queue == least])


class RoundRobinRouter:
    """Each request to the next replica in turn (another one only when it is full): the
    baseline `python -m bench scale` measures prefix affinity against."""

    def __init__(self) -> None:
        self.count = 0  # turns routed so far

    def choose(self, turn: Turn, candidates: list[Candidate]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.replica_id)
        first = ordered[self.count % len(ordered)]
        self.count += 1
        return first if first.has_room else shortest(ordered)

    def routed(self, turn: Turn, replica_id: str) -> None:
        pass

    def forget(self, replica_id: str) -> None:
        pass


class PrefixAffinityRouter:
    """The engine replicas' routing policy (see the module docstring)."""

    def __init__(self, imbalance_threshold: int = 2, min_match_fraction: float = 0.5,
                 blocks_per_replica: int = 65536, max_sessions: int = 100_000) -> None:
        if imbalance_threshold < 0 or not 0 <= min_match_fraction <= 1 \
                or blocks_per_replica < 1 or max_sessions < 1:
            raise ValueError("imbalance_threshold must be >= 0, min_match_fraction in [0, 1], "
                             "blocks_per_replica and max_sessions >= 1")
        self.imbalance_threshold = imbalance_threshold
        self.min_match_fraction = min_match_fraction
        self.blocks_per_replica = blocks_per_replica
        self.max_sessions = max_sessions
        self.blocks: dict[str, ReplicaBlocks] = {}
        self.sessions: OrderedDict[str, str] = OrderedDict()

    def choose(self, turn: Turn, candidates: list[Candidate]) -> Candidate:
        """The replica for `turn` among `candidates` (at least one)."""
        by_id = {c.replica_id: c for c in candidates}
        if turn.session is not None:
            sticky = by_id.get(self.sessions.get(turn.session))
            if sticky is not None and sticky.has_room:
                return sticky
        hashes = block_hashes(turn.prompt_token_ids)
        best, best_len = None, 0
        for candidate in candidates:
            record = self.blocks.get(candidate.replica_id)
            n = record.match(hashes) if record is not None else 0
            if n > best_len:
                best, best_len = candidate, n
        worth_it = best_len * BLOCK_SIZE >= self.min_match_fraction * len(turn.prompt_token_ids)
        if best is not None and worth_it and best.has_room:
            least = min(c.queue for c in candidates)
            if best.queue - least <= self.imbalance_threshold:
                return best
        return shortest(candidates)

    def routed(self, turn: Turn, replica_id: str) -> None:
        """`turn` went to `replica_id`: its blocks are cached there, its conversation too."""
        record = self.blocks.get(replica_id)
        if record is None:
            record = self.blocks[replica_id] = ReplicaBlocks(self.blocks_per_replica)
        record.insert(block_hashes(turn.prompt_token_ids))
        if turn.session is not None:
            self.sessions[turn.session] = replica_id
            self.sessions.move_to_end(turn.session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """The replica died: its cache died with it, and its conversations move on."""
        self.blocks.pop(replica_id, None)
        for session in [s for s, r in self.sessions.items() if r == replica_id]:
            del self.sessions[session]
