"""The cluster's pure parts without a cluster: block keys, the per-replica block record, the
routing policies over candidate replicas, the scheduler counts behind the vLLM gauges, and
the CLI's refusals before Ray starts."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from specserve.cli import main  # noqa: E402
from specserve.cluster import ClusterOptions  # noqa: E402
from specserve.cluster.router import (  # noqa: E402
    BLOCK_SIZE,
    Candidate,
    PrefixAffinityRouter,
    ReplicaBlocks,
    RoundRobinRouter,
    block_hashes,
    shortest,
)
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


# ---- the routing policies, over candidates --------------------------------------------------
def turn(ids: list[int], session: str | None = None):
    from specserve.cluster.channel import Turn
    from specserve.sampling import SamplingParams

    return Turn(ids, SamplingParams(max_tokens=4), "r", None, session)


def candidates(queues: dict[str, int], capacity: int = 8) -> list[Candidate]:
    return [Candidate(rid, queue, capacity) for rid, queue in queues.items()]


def test_router_prefers_the_replica_holding_the_prefix_unless_its_queue_is_clearly_longer():
    router = PrefixAffinityRouter()
    prompt = list(range(64))  # 4 blocks
    router.routed(turn(prompt), "b")
    assert router.choose(turn(prompt[:48] + [7] * 16), candidates({"a": 0, "b": 0})) \
        .replica_id == "b"
    # 3 more than a: past the imbalance threshold (2); at 2 it still wins.
    assert router.choose(turn(prompt), candidates({"a": 0, "b": 3})).replica_id == "a"
    assert router.choose(turn(prompt), candidates({"a": 0, "b": 2})).replica_id == "b"
    # A match under half the prompt (one shared block of five) goes by load.
    assert router.choose(turn(prompt[:16] + [9] * 64), candidates({"a": 1, "b": 0})) \
        .replica_id == "b"
    assert router.choose(turn(prompt[:16] + [9] * 64), candidates({"a": 0, "b": 1})) \
        .replica_id == "a"
    # A full replica is passed over however much it holds.
    assert router.choose(turn(prompt), candidates({"a": 2, "b": 2}, capacity=2)) \
        .replica_id in {"a", "b"}
    assert router.choose(turn(prompt), [Candidate("a", 1, 2), Candidate("b", 2, 2)]) \
        .replica_id == "a"


def test_router_keeps_a_conversation_on_its_replica_while_it_lives():
    router = PrefixAffinityRouter()
    router.routed(turn([1] * 20, "s1"), "a")
    assert router.choose(turn([5] * 40, "s1"), candidates({"a": 1, "b": 0})).replica_id == "a"
    assert router.choose(turn([5] * 40, "s1"), candidates({"b": 0})).replica_id == "b"  # a gone
    router.forget("a")  # a died: its conversations and blocks with it
    assert "s1" not in router.sessions and "a" not in router.blocks


def test_routers_spread_equal_queues_and_prefer_room():
    router = PrefixAffinityRouter()
    picks = {router.choose(turn([3] * 8), candidates({"a": 0, "b": 0, "c": 0})).replica_id
             for _ in range(60)}
    assert picks == {"a", "b", "c"}  # a random one of equals, not always the first
    assert shortest([Candidate("a", 1, 1), Candidate("b", 3, 4)]).replica_id == "b"
    assert shortest([Candidate("a", 1, 1), Candidate("b", 4, 4)]).replica_id == "a"  # all full


def test_round_robin_takes_each_replica_in_turn_and_falls_back_to_the_others():
    router = RoundRobinRouter()
    prompt = turn(list(range(64)))  # the same prompt each time: no affinity here
    firsts = [router.choose(prompt, candidates({"c": 0, "a": 0, "b": 0})).replica_id
              for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert router.choose(prompt, candidates({"b": 0, "a": 0})).replica_id == "a"  # turn 6 of 2
    # Turn 7 of 2 is b's, but b is full: the shortest queue with room.
    assert router.choose(prompt, [Candidate("a", 1, 2), Candidate("b", 2, 2)]).replica_id == "a"


def test_cluster_options_refuse_an_unknown_routing_and_bad_router_options():
    with pytest.raises(ValueError, match="routing must be one of prefix, round_robin"):
        ClusterOptions(engine_options={}, routing="random")
    with pytest.raises(ValueError, match="imbalance_threshold"):
        ClusterOptions(engine_options={}, router_options={"imbalance_threshold": -1})
