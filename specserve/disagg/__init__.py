"""Prefill/decode disaggregation: prompts computed on a prefill server, their KV moved by
blocks to a decode server that streams (`specserve serve --role prefill|decode`).

protocol.py (messages and framing), transport.py (the KV transport interface, TCP backend),
handoff.py (what leaves a prefill engine and enters a decode engine), prefill.py (the prefill
role and its route), decode.py (the decode role's engine).
"""
