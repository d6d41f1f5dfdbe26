"""compat: pure name mapping, checkpoint layouts, the manifest check, and version/feature detection.

Nothing here runs a collective or holds trainer state; `fsdp_sync` builds on it, never the other way round. The
adapters only read what the installed vLLM, TRL and torch offer (`engine_api`, `reload_api`, `weight_transfer`,
`server_api`, `trl_api`, `torch_api`); the one module that changes what vLLM does is `vllm_patches`, each patch
saying which versions need it and when it can go.
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
