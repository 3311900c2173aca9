"""Speculative decoding: speculation modes, token trees, proposers and lossless verification."""
