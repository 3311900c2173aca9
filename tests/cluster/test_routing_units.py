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
