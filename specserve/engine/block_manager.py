"""KV block pool with reference counts and prefix caching. Pure Python: block ids, no tensors.

A request's KV lives in fixed-size blocks listed in its block table. Logical position `p` sits in
block `block_table[p // block_size]` at offset `p % block_size`:

    block table:  [ b7      | b2      | b9      | b4    ]
    positions:    | computed          | new   | lookahead (draft tree) |

A full block of committed, computed tokens gets a hash chained over every token before it, so a
later request with the same prefix (a system prompt, an earlier chat turn) can share the block.
Freed blocks keep their hash and stay reusable until the pool needs them back, least recently
freed first. Every mutating call has a side-effect-free check beside it (`can_allocate`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for; callers check `can_allocate` first."""


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first)."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # Blocks with ref count 0, oldest first. Insertion order is the eviction order.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0  # full prompt blocks looked up
        self.prefix_hits = 0  # of those, found cached

    # ---- pool -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks (ref count 1), evicting the least recently freed cached ones."""
        if not self.can_allocate(n):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self.free)} free "
                                    f"of {self.num_blocks}")
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._forget_hash(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced blocks return to the pool.

        Freed in reverse so a request's tail blocks are evicted before its shared prefix.
        """
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    # ---- prefix cache ---------------------------------------------------------------------
    def full_block_hashes(self, token_ids: Sequence[int], parent: int | None = None,
                          start_block: int = 0, end_block: int | None = None) -> list[int]:
        """Chained hashes of full blocks [start_block, end_block) of token_ids."""
        bs = self.block_size
        end = len(token_ids) // bs if end_block is None else end_block
        hashes = []
        for i in range(start_block, end):
            parent = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def lookup_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Cached blocks matching the leading hashes. No side effects."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def record_prefix_lookup(self, queried: int, hit: int) -> None:
        """Count a lookup that was acted on (a request admitted), for the hit rate."""
        self.prefix_queries += queried
        self.prefix_hits += hit

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference to already-filled blocks (a prefix cache hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1

    def cache_block(self, block: int, block_hash: int) -> None:
        """Register a block that now holds a full block of committed, computed tokens."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:  # an identical block is already shared; keep that one
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def check_no_leak(self) -> None:
        """Raise unless every block is back in the pool (for tests and shutdown checks)."""
        held = [b for b, c in enumerate(self.ref_counts) if c]
        if held or len(self.free) != self.num_blocks:
            raise AssertionError(f"KV blocks still held: {held[:16]} "
                                 f"({self.num_blocks - len(self.free)} of {self.num_blocks})")
