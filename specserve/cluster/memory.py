"""What a replica process reports of its own memory (engine and prefill replicas alike)."""

from __future__ import annotations

import os


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux's /proc; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
