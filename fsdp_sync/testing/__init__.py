"""Test and demo support: tiny local models, a real-FSDP-on-CPU enabler for accelerate, and engine oracles.

Nothing here is used by the sync itself. It ships with the package so that users can check their own stack on a CPU
machine (`fsdp-vllm-sync-demo`) the same way our tests do.
"""
