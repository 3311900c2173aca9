"""The cluster's pure parts without a cluster: block keys, the per-replica block record, the
scheduler counts behind the vLLM gauges, and the CLI's refusals before Ray starts."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from specserve.cli import main  # noqa: E402
from specserve.cluster import ClusterOptions  # noqa: E402
from specserve.cluster.router import BLOCK_SIZE, ReplicaBlocks, block_hashes  # noqa: E402
from specserve.server.metrics import scheduler_counts  # noqa: E402


def test_block_hashes_key_whole_prefixes():
    a = list(range(50))
    b = list(range(40)) + [999] * 10
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 50 // BLOCK_SIZE == 3  # the partial last block has no key
    assert ha[:2] == hb[:2] and ha[2] != hb[2]  # block 3 differs (tokens 32..47)
    # A block's key covers everything before it: the same block after another prefix differs.
    assert block_hashes([7] * 16 + a[:16])[1] != block_hashes([8] * 16 + a[:16])[1]
    assert block_hashes(list(range(15))) == []


def test_replica_blocks_match_leading_blocks_and_forget_the_oldest():
    record = ReplicaBlocks(capacity=4)
    first = block_hashes(list(range(48)))  # 3 blocks
    record.insert(first)
    assert record.match(first) == 3
    assert record.match(block_hashes(list(range(32)) + [5] * 16)) == 2
    assert record.match(block_hashes([1] * 48)) == 0
    record.insert(block_hashes([2] * 32))  # 2 more blocks: the oldest one goes
    assert len(record.keys) == 4
    assert record.match(first) == 0  # its first block was the least recently used


def test_scheduler_counts():
    assert scheduler_counts(0, 4) == (0, 0)
    assert scheduler_counts(3, 4) == (3, 0)
    assert scheduler_counts(7, 4) == (4, 3)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_cluster_options_refuse_bad_replica_counts(bad):
    with pytest.raises(ValueError, match="--replicas"):
        ClusterOptions(engine_options={}, num_replicas=bad)


@pytest.mark.parametrize("argv, message", [
    (["serve", "--ray-address", "auto"], "--ray-address needs --replicas"),
    (["serve", "--replicas", "0"], "--replicas must be at least 1"),
    (["serve", "--replicas", "2", "--tp", "2"], "not supported with --replicas"),
    (["serve", "--replicas", "2", "--target", "/no/such/model"], "no such model"),
])
def test_cli_refuses_bad_cluster_flags_before_ray_starts(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ---- the routing policy, over fake replicas ---------------------------------------------------
class FakeReplica:
    def __init__(self, name: str) -> None:
        self.replica_id = name
        self.max_ongoing_requests = 8


class FakeRequest:
    def __init__(self, turn) -> None:
        self.args = [turn]


def make_router(queues: dict[str, int]):
    from specserve.cluster.router import PrefixAffinityRouter

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # no Serve handle around it
    router.initialize_state()
    router._replica_queue_len_cache = queues  # what `replica_queue_len_cache` reads
    return router


def turn(ids: list[int], session: str | None = None):
    from specserve.cluster.replica import Turn
    from specserve.sampling import SamplingParams

    return Turn(ids, SamplingParams(max_tokens=4), "r", None, session)


def choose(router, replicas, t) -> list[list[str]]:
    import asyncio

    ranks = asyncio.run(router.choose_replicas(replicas, FakeRequest(t)))
    return [[r.replica_id for r in rank] for rank in ranks]


def test_router_prefers_the_replica_holding_the_prefix_unless_its_queue_is_clearly_longer():
    a, b = FakeReplica("a"), FakeReplica("b")
    queues = {"a": 0, "b": 0}
    router = make_router(queues)
    prompt = list(range(64))  # 4 blocks
    assert choose(router, [a, b], turn(prompt)) == [["a", "b"]]  # nothing cached: by load
    router.on_request_routed(FakeRequest(turn(prompt)), "b", None)
    assert choose(router, [a, b], turn(prompt[:48] + [7] * 16)) == [["b"], ["a"]]
    queues["b"] = 3  # 3 more than a: past the imbalance threshold (2)
    assert choose(router, [a, b], turn(prompt)) == [["a", "b"]]
    queues["b"] = 2
    assert choose(router, [a, b], turn(prompt)) == [["b"], ["a"]]
    # A match under half the prompt (one shared block of five) goes by load.
    assert choose(router, [a, b], turn(prompt[:16] + [9] * 64)) == [["a", "b"]]


def test_router_keeps_a_conversation_on_its_replica_while_it_lives():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = make_router({"a": 0, "b": 0})
    router.on_request_routed(FakeRequest(turn([1] * 20, "s1")), "a", None)
    assert choose(router, [a, b], turn([5] * 40, "s1")) == [["a"], ["b"]]
    assert choose(router, [b], turn([5] * 40, "s1")) == [["b"]]  # a is gone: any other


def test_round_robin_takes_each_replica_in_turn_and_falls_back_to_the_others():
    from specserve.cluster.router import RoundRobinRouter

    router = RoundRobinRouter.__new__(RoundRobinRouter)
    router.initialize_state()
    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    prompt = turn(list(range(64)))  # the same prompt each time: no affinity here
    firsts = [choose(router, [c, a, b], prompt)[0][0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert choose(router, [b, a], prompt) == [["a"], ["b"]]  # turn 6 of 2 replicas


def test_cluster_options_refuse_an_unknown_routing():
    with pytest.raises(ValueError, match="routing must be one of prefix, round_robin"):
        ClusterOptions(engine_options={}, routing="random")
