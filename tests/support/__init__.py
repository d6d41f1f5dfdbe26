"""What only the tests (and the repository's benchmarks) run: the test job with its fault injections and probes,
the fork server the end-to-end jobs start from, the distributed launcher of tests/dist, the AsyncGRPO job and its
CPU stand-ins. None of it ships in the wheel; the demo's job and weight checks (`fsdp_sync._demo`) do.
"""
