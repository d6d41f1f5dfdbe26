"""The demo's job and what it runs (private: not API, may change between releases): tiny local models, the launcher,
a real vLLM server process, a real-FSDP-on-CPU enabler for accelerate, and the bit-exact weight check.

Nothing here is used by the sync itself. It ships for one reason: `fsdp-vllm-sync-demo` runs a real GRPO job with the
same bit-exact check the tests run, so users can check their own stack on a CPU machine. The tests' job
(tests/support/grpo_job.py: fault injection, probes, TRL's own sync) is this job with `JobHooks`; the test machinery
stays in tests/support and never ships (tests/unit/test_packaging.py builds the wheel and lists it).
"""
