"""Every error class README.md and docs/ name is importable from `fsdp_sync`, is a `SyncError` (docs/failures.md:
"every error a sync raises is one"), and is what the user catches: raised inside a sync, the failing rank gets the
class itself (its own error chained as `__cause__`), not a wrapper that an `except` of the documented class misses.

An error class is any name ending in `Error` or `Exception`, and any exception class this package defines, whatever
its name ends in (`ServerRouteMissing`), read from the source."""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

import fsdp_sync
from tests.support.dist import free_port
from fsdp_sync.distributed import Coordinator, agreed
from fsdp_sync.errors import RankFailure, agreed_error

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_NAME = re.compile(r"\b([A-Z][A-Za-z0-9]*(?:Error|Exception))\b")


def _package_exceptions() -> set[str]:
    """The names of the exception classes `fsdp_sync/` and `compat/` define: classes whose bases are, transitively,
    Python's exceptions or such classes (read from the source, every module: nothing is imported)."""
    bases: dict[str, set[str]] = {}
    for folder in (ROOT / "fsdp_sync", ROOT / "compat"):
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    named = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                             if isinstance(b, (ast.Name, ast.Attribute))}  # fmt: skip
                    bases.setdefault(node.name, set()).update(named)
    found = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    ours: set[str] = set()
    while True:
        more = {name for name, of in bases.items() if name not in ours and of & (found | ours)}
        if not more:
            return ours
        ours |= more


PACKAGE_EXCEPTIONS = _package_exceptions()
# Those whose names the pattern above misses, as words of the pages.
_CLASS = re.compile(r"\b(" + "|".join(sorted(n for n in PACKAGE_EXCEPTIONS if not _NAME.fullmatch(n))) + r")\b")
# The two a rank raises for a failure that is not its own class: another rank's, or a stage's plain exception.
_WRAPPERS = {"RemoteSyncError", "SyncStageError"}


def _documented() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for name in [*_NAME.findall(line), *_CLASS.findall(line)]:
                found.setdefault(name, []).append(f"{page.relative_to(ROOT)}:{n}")
    return found


DOCUMENTED = _documented()
# Python's own (`AttributeError`, what stock TRL raises) are named as what other code raises, not caught from here.
OURS = sorted(name for name in DOCUMENTED if not hasattr(builtins, name))


def test_the_docs_name_errors() -> None:
    """The checks below have something to check, also a class whose name does not end in Error."""
    assert {"SyncError", "UnsupportedBackendError", "ManifestError", "ServerTransportError"} <= set(OURS), OURS
    assert "ServerRouteMissing" in OURS, OURS


def test_the_package_exceptions_are_read_from_the_source() -> None:
    """The reader finds exception classes by their bases, through the package's own classes."""
    assert {"SyncError", "ServerConfigError", "ServerRouteMissing", "ServerNoAnswerError", "UsageError"} <= (
        PACKAGE_EXCEPTIONS
    )
    assert "SyncConfig" not in PACKAGE_EXCEPTIONS and "ServerWriter" not in PACKAGE_EXCEPTIONS


@pytest.mark.parametrize("name", OURS)
def test_a_documented_error_is_importable_from_fsdp_sync_and_is_a_sync_error(name: str) -> None:
    assert name in fsdp_sync.__all__, f"{name} (named at {DOCUMENTED[name][:3]}) is not exported by fsdp_sync"
    cls = getattr(fsdp_sync, name)
    assert isinstance(cls, type) and issubclass(cls, fsdp_sync.SyncError), (
        f"{name} is not a SyncError, but docs/failures.md says every error a sync raises is one"
    )


@pytest.mark.parametrize("name", sorted(set(OURS) - _WRAPPERS - {"SyncError"}))
def test_the_failing_rank_receives_the_documented_class(name: str) -> None:
    """What every sync stage does with its own error (`agreed_error`): a documented class stays itself on the rank
    that raised it, so `except <that class>` catches it; the original is the `__cause__`."""
    cls = getattr(fsdp_sync, name)
    own = cls("what went wrong")
    raised = agreed_error(own, [RankFailure(0, "build", "what went wrong")], None)
    assert type(raised) is cls and raised.__cause__ is own
    assert "rank 0 (build): what went wrong" in str(raised)


def test_a_plain_exception_arrives_as_the_cause_of_a_sync_stage_error() -> None:
    """What docs/failures.md says of the trainer's own stages."""
    own = KeyError("x")
    raised = agreed_error(own, [RankFailure(0, "map", "KeyError: 'x'")], None)
    assert type(raised) is fsdp_sync.SyncStageError and raised.__cause__ is own


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_a_tensor_parallel_model_raises_unsupported_backend_error_from_the_mixin(one_rank: None) -> None:
    """README's "tensor parallelism ... raise `UnsupportedBackendError`", through the mixin's own build step (the
    trainer is a stand-in holding what that step reads; the step fails at the backend, before it needs more)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (1,))
    model[1].weight = nn.Parameter(distribute_tensor(model[1].weight.detach(), mesh, [Replicate()]))
    trainer = SimpleNamespace(sync_config=fsdp_sync.SyncConfig(), _fvs_builtin_sync=None, _fvs_target=None)
    with pytest.raises(fsdp_sync.UnsupportedBackendError) as err:
        fsdp_sync.FSDPVLLMSyncMixin._fvs_build(trainer, model)  # type: ignore[arg-type]
    assert isinstance(err.value, fsdp_sync.SyncError)
    assert isinstance(err.value.__cause__, fsdp_sync.UnsupportedBackendError)
    assert "rank 0 (build)" in str(err.value) and "1.weight" in str(err.value)


def test_a_dora_adapter_raises_unsupported_adapter_error_from_an_agreed_stage(tmp_path: Path) -> None:
    """README's "adapters that are not additive deltas (DoRA, ...) raise `UnsupportedAdapterError`", through the
    agreement every sync stage runs (one rank)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fsdp_sync._demo.models import build_tiny_checkpoint
    from fsdp_sync.compat.names import NameRules

    directory = build_tiny_checkpoint(tmp_path, "qwen2")
    base = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"], use_dora=True))
    with pytest.raises(fsdp_sync.UnsupportedAdapterError) as err:
        agreed(
            Coordinator(30.0),
            "build",
            lambda: fsdp_sync.PeftMerge.for_model(model, NameRules.for_model(model)),
            lambda e, failures: agreed_error(e, failures, None),
        )
    assert isinstance(err.value, fsdp_sync.SyncError) and isinstance(err.value, ValueError)
    assert "q_proj" in str(err.value) and "rank 0 (build)" in str(err.value)
