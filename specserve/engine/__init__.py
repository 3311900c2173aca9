"""The engine: requests, KV block accounting, scheduling, the step loop and its async wrapper."""
