"""Loaded at interpreter start by the processes whose PYTHONPATH holds this folder, and only those: the vLLM servers
the demo and the tests start (`fsdp_sync._demo.vllm_server`) and the ranks of the vision-language tests. Nothing puts
it into a user's processes.

- The torchvision stand-ins (`fsdp_sync._demo.no_torchvision`): a no-op where torchvision is installed.
- Readable engine weights and the test digest method, where `FSDP_VLLM_SYNC_TEST_READABLE_WEIGHTS=1`.
"""

import os

from fsdp_sync._demo.no_torchvision import install

install()
if os.environ.get("FSDP_VLLM_SYNC_TEST_READABLE_WEIGHTS") == "1":
    from fsdp_sync._demo.vllm_server import install_readable_weights

    install_readable_weights()
