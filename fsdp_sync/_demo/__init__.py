"""The demo's job and what it needs (private: not API, may change between releases): tiny local models, the
launcher, a real vLLM server process, a real-FSDP-on-CPU enabler for accelerate, and the engine oracles.

Nothing here is used by the sync itself. It ships with the package for one reason: `fsdp-vllm-sync-demo` runs the
same GRPO job, with the same bit-exact checks, that the tests run, so users can check their own stack on a CPU
machine. The tests and benchmarks import it too; fault injection goes through the public seam `fsdp_sync.faults`.
"""
