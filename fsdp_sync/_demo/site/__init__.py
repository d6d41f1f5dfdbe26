"""A folder the demo's vLLM server processes get on their PYTHONPATH, for its `sitecustomize` (see
`fsdp_sync._demo.vllm_server`); a package so that installs ship it as one (not as loose package data)."""
