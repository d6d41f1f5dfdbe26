"""Weight-transfer backends for vLLM's weight-update API, registered through the `vllm.general_plugins` entry point.

A separate room: this package runs inside vLLM server processes as well as in the trainer. It imports torch and vLLM
only: no gatherer, no mixin, no TRL; the trainer side reaches it through vLLM's registries
(`WeightTransferEngineFactory`, `WeightTransferTrainerFactory`), as it reaches vLLM's own backends. Every question
the trainer asks the server's workers is declared, answered and asked in one module (`questions`), whose worker side
the plugin installs on every server, whatever its backend.
"""
