"""Prefix-aware routing: send a turn to the replica whose prefix cache most likely holds its
prompt, unless that replica's queue is clearly longer than the least-loaded one's.

The router runs inside the gateway's process (Ray Serve builds one per deployment handle, on
the handle's own event loop thread). It
keeps, per replica, the chained hashes of the full KV blocks of the prompts it sent there: the
same block-granular keys the engine's prefix cache uses, so a match of k blocks means the
replica computed those k blocks recently. Like SGLang's cache-aware router and Ray's
PrefixCacheAffinityRouter, this is the router's own record, not a query of the replica, so it
costs no round trip; each record is bounded (least recently used blocks go first), as the
replica's cache is. Ray's PrefixCacheAffinityRouter is not used: it matches characters of a
`.prompt`/`.messages` argument through a separate actor with a blocking call per request, and
it has no conversation stickiness.

Order of preference for one request:
1. its conversation's replica (`Turn.session`), while that replica is alive and not full;
2. the replica with the longest block match, when the match covers at least
   `min_match_fraction` of the prompt (a shared chat template alone should not pull every
   request to one replica) and its queue exceeds the shortest queue by at most
   `imbalance_threshold` requests;
3. every replica, the shortest queue first (Ray's own choice among a rank).
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import registry
from .replica import Turn

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


class ReportingRouter(RequestRouter):
    """What every router of the engine replicas does: it registers itself, so the gateway's
    /health and /metrics read the replicas' reports through it."""

    def initialize_state(self) -> None:
        registry.register(self)

    def replica_reports(self) -> dict[str, dict]:
        """Each live replica's last `record_routing_stats` report, by its full id."""
        # A copy first: the router's loop may change the replicas while the gateway reads.
        return {rid.to_full_id_str(): replica.routing_stats
                for rid, replica in dict(self.curr_replicas).items()}


class RoundRobinRouter(ReportingRouter):
    """Each request to the next replica in turn (another one only when it is full): the
    baseline `python -m bench scale` measures prefix affinity against."""

    def initialize_state(self) -> None:
        super().initialize_state()
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return [candidate_replicas]
        ordered = sorted(candidate_replicas, key=lambda r: str(r.replica_id))
        i = self.turn % len(ordered)
        self.turn += 1
        return [[ordered[i]], ordered[:i] + ordered[i + 1:]]


class PrefixAffinityRouter(ReportingRouter):
    """Ray Serve request router for the engine replicas (see the module docstring)."""

    def initialize_state(self, imbalance_threshold: int = 2, min_match_fraction: float = 0.5,
                         blocks_per_replica: int = 65536, max_sessions: int = 100_000) -> None:
        if imbalance_threshold < 0 or not 0 <= min_match_fraction <= 1 \
                or blocks_per_replica < 1 or max_sessions < 1:
            raise ValueError("imbalance_threshold must be >= 0, min_match_fraction in [0, 1], "
                             "blocks_per_replica and max_sessions >= 1")
        self.imbalance_threshold = imbalance_threshold
        self.min_match_fraction = min_match_fraction
        self.blocks_per_replica = blocks_per_replica
        self.max_sessions = max_sessions
        self.blocks: dict[ReplicaID, ReplicaBlocks] = {}
        self.sessions: OrderedDict[str, ReplicaID] = OrderedDict()
        super().initialize_state()

    def _queue_len(self, replica: RunningReplica) -> int:
        # The handle's cache of each replica's ongoing requests; unknown counts as idle (Ray
        # probes it when it picks among a rank).
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def _has_room(self, replica: RunningReplica) -> bool:
        return self._queue_len(replica) < replica.max_ongoing_requests

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        turn = _turn(pending_request)
        if turn is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        others = list(candidate_replicas)
        if turn.session is not None:
            sticky = by_id.get(self.sessions.get(turn.session))
            if sticky is not None and self._has_room(sticky):
                others.remove(sticky)
                return [[sticky], others]
        hashes = block_hashes(turn.prompt_token_ids)
        best, best_len = None, 0
        for replica in candidate_replicas:
            record = self.blocks.get(replica.replica_id)
            n = record.match(hashes) if record is not None else 0
            if n > best_len:
                best, best_len = replica, n
        worth_it = best_len * BLOCK_SIZE >= self.min_match_fraction * len(turn.prompt_token_ids)
        if best is not None and worth_it:
            shortest = min(self._queue_len(r) for r in candidate_replicas)
            if self._queue_len(best) - shortest <= self.imbalance_threshold:
                others.remove(best)
                return [[best], others]
        return [candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        turn = _turn(pending_request)
        if turn is None:
            return
        hashes = block_hashes(turn.prompt_token_ids)
        record = self.blocks.get(replica_id)
        if record is None:
            record = self.blocks[replica_id] = ReplicaBlocks(self.blocks_per_replica)
        record.insert(hashes)
        if turn.session is not None:
            self.sessions[turn.session] = replica_id
            self.sessions.move_to_end(turn.session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        # Its cache died with it: forget its blocks, and let its conversations move on.
        super().on_replica_actor_died(replica_id)
        self.blocks.pop(replica_id, None)
        for session in [s for s, r in self.sessions.items() if r == replica_id]:
            del self.sessions[session]


def _turn(pending_request: PendingRequest | None):
    """The `Turn` a request carries (its first argument), or None for other calls."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, Turn) else None
