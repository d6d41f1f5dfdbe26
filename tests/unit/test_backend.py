"""`fsdp_sync.backend` on real wrappers (DDP, FSDP1, FSDP2 on a one-process gloo group), `SyncConfig` validation, and
`MemoryMeter` accounting on CPU."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_sync.backend import Backend, UnsupportedBackendError, detect_backend, unwrap_outer, user_model
from fsdp_sync.config import SyncConfig
from fsdp_sync.memory import MemoryMeter
from tests.support.dist import free_port

CPU = torch.device("cpu")

# One process: FSDP1 says it falls back to NO_SHARD; expected here, not a finding.
pytestmark = pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A one-process gloo group for the module's wrapper tests; destroyed at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture
def mesh(process_group: None) -> DeviceMesh:
    return init_device_mesh("cpu", (1,))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# --- detect_backend / unwrap_outer / user_model ---------------------------------------------------------------------


def test_plain_module() -> None:
    """A module with no wrapper is PLAIN and is its own outer-unwrapped and user model."""
    model = _model()
    assert detect_backend(model) is Backend.PLAIN
    assert unwrap_outer(model) is model
    assert user_model(model) is model


def test_ddp(process_group: None) -> None:
    """DDP is detected as DDP; unwrap_outer and user_model both return the wrapped module."""
    model = _model()
    wrapped = DDP(model)
    assert detect_backend(wrapped) is Backend.DDP
    assert unwrap_outer(wrapped) is model
    assert user_model(wrapped) is model


def test_data_parallel_counts_as_ddp() -> None:
    """DataParallel (already full on every device) is gathered like DDP and unwrapped the same way."""
    model = _model()
    wrapped = nn.DataParallel(model)
    assert detect_backend(wrapped) is Backend.DDP
    assert unwrap_outer(wrapped) is model


def test_fsdp1_root(process_group: None) -> None:
    """An FSDP1 root is FSDP1; unwrap_outer keeps it (gathering needs it) and user_model returns the inner module."""
    model = _model()
    wrapped = FSDP(model, device_id=CPU)
    assert detect_backend(wrapped) is Backend.FSDP1
    assert unwrap_outer(wrapped) is wrapped
    assert user_model(wrapped) is model


def test_fsdp1_nested_units_inside_plain_root(process_group: None) -> None:
    """FSDP1 units below a plain root are found in the module tree."""
    model = _model()
    model[0] = FSDP(model[0], device_id=CPU)
    assert detect_backend(model) is Backend.FSDP1


def test_fsdp2(mesh: DeviceMesh) -> None:
    """A model with fully_shard units is FSDP2 and is not unwrapped (fully_shard changes the class in place)."""
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    assert detect_backend(model) is Backend.FSDP2
    assert unwrap_outer(model) is model
    assert user_model(model) is model


def test_dtensor_parameters_without_fsdp2_unit_rejected(mesh: DeviceMesh) -> None:
    """DTensor parameters with no FSDP2 unit (tensor-parallel style) raise UnsupportedBackendError naming them."""
    model = _model()
    model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh, [Replicate()]))
    with pytest.raises(UnsupportedBackendError, match=r"2\.weight") as err:
        detect_backend(model)
    assert "1 parameter(s) are DTensors" in str(err.value)
    assert "0.weight" not in str(err.value)


def test_deepspeed_engine_recognised_not_gathered() -> None:
    """A DeepSpeedEngine is recognised by class name; no gatherer is built for it (left to the trainer's sync)."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.gather import make_gatherer

    class DeepSpeedEngine(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    engine = DeepSpeedEngine(_model())
    assert detect_backend(engine) is Backend.DEEPSPEED
    with pytest.raises(UnsupportedBackendError, match="DeepSpeed"):
        make_gatherer(engine, Backend.DEEPSPEED, SyncConfig())


def test_fsdp1_and_fsdp2_mixed_rejected(mesh: DeviceMesh) -> None:
    """A tree holding both FSDP1 and FSDP2 units raises UnsupportedBackendError naming both."""
    model = _model()
    model[0] = FSDP(model[0], device_id=CPU)
    fully_shard(model[2], mesh=mesh)
    with pytest.raises(UnsupportedBackendError, match="mixes FSDP1") as err:
        detect_backend(model)
    assert "fully_shard" in str(err.value)


def test_compiled_plain_model_is_unwrapped() -> None:
    """torch.compile around a plain model is removed by unwrap_outer and user_model; the backend stays PLAIN."""
    model = _model()
    compiled = torch.compile(model, backend="eager")
    assert compiled is not model
    assert unwrap_outer(compiled) is model
    assert user_model(compiled) is model
    assert detect_backend(compiled) is Backend.PLAIN


def test_ddp_around_compiled_model_is_fully_unwrapped(process_group: None) -> None:
    """DDP around a compiled model: both wrappers are removed, in order."""
    model = _model()
    wrapped = DDP(torch.compile(model, backend="eager"))
    assert detect_backend(wrapped) is Backend.DDP
    assert unwrap_outer(wrapped) is model
    assert user_model(wrapped) is model


def test_compiled_fsdp2_unit_is_kept(mesh: DeviceMesh) -> None:
    """A compiled module that fully_shard made an FSDP2 unit is not unwrapped by unwrap_outer (it is the unit)."""
    model = _model()
    compiled = torch.compile(model, backend="eager")
    fully_shard(compiled, mesh=mesh)
    assert detect_backend(compiled) is Backend.FSDP2
    assert unwrap_outer(compiled) is compiled
    assert user_model(compiled) is model


# --- SyncConfig ---------------------------------------------------------------------------------------------------


def test_sync_config_defaults_and_valid_strategies() -> None:
    """Every documented strategy pair is accepted; the defaults are the flat strategy on both FSDP versions (the
    fastest measured, docs/benchmarks.md)."""
    assert (SyncConfig().fsdp1_strategy, SyncConfig().fsdp2_strategy) == ("flat", "flat")
    for fsdp1 in ("flat", "unit", "root"):
        for fsdp2 in ("flat", "unit", "param"):
            config = SyncConfig(fsdp1_strategy=fsdp1, fsdp2_strategy=fsdp2)
            assert (config.fsdp1_strategy, config.fsdp2_strategy) == (fsdp1, fsdp2)


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("fsdp1_strategy", "param", ["flat", "unit", "root"]),
        ("fsdp1_strategy", "Unit", ["flat", "unit", "root"]),
        ("fsdp2_strategy", "root", ["flat", "unit", "param"]),
        ("fsdp2_strategy", "", ["flat", "unit", "param"]),
    ],
)
def test_sync_config_bad_strategy_names_bad_and_valid_values(field: str, value: str, valid: list[str]) -> None:
    """A bad strategy raises ValueError naming the field, the bad value and the valid ones."""
    with pytest.raises(ValueError) as err:
        SyncConfig(**{field: value})
    message = str(err.value)
    assert f"{field}={value!r}" in message
    listed = message.split("valid:", 1)[1]
    for name in valid:
        assert repr(name) in listed
    assert repr(value) not in listed


# --- MemoryMeter --------------------------------------------------------------------------------------------------


def test_memory_meter_cpu_is_accounted() -> None:
    """On CPU the meter's source is the accounting, and peak_extra_bytes is the accounted peak."""
    meter = MemoryMeter(CPU)
    meter.start()
    meter.hold(10)
    assert meter.source == "accounted"
    assert meter.peak_extra_bytes() == meter.accounted_peak_bytes == 10


def test_memory_meter_hold_release_keeps_high_water_mark() -> None:
    """The peak is the highest sum of held bytes; a release lowers what is held, not the peak; start() resets."""
    meter = MemoryMeter(CPU)
    meter.start()
    meter.hold(100)
    meter.hold(50)
    meter.release(100)
    meter.hold(20)  # held 70
    assert meter.peak_extra_bytes() == 150
    meter.hold(90)  # held 160
    assert meter.peak_extra_bytes() == 160
    meter.start()
    assert meter.peak_extra_bytes() == 0
    meter.hold(5)
    assert meter.peak_extra_bytes() == 5  # what was held before start() no longer counts


def test_memory_meter_hold_until_freed_releases_after_del() -> None:
    """A tensor given to hold_until_freed counts until it is garbage collected, then is released."""
    meter = MemoryMeter(CPU)
    meter.start()
    tensor = torch.empty(100, dtype=torch.float32)
    meter.hold_until_freed(tensor)
    assert meter.peak_extra_bytes() == 400
    meter.hold(1)
    assert meter.peak_extra_bytes() == 401  # still held: the peak adds up
    meter.release(1)
    del tensor
    gc.collect()
    meter.hold(300)
    assert meter.peak_extra_bytes() == 401  # released: 300 held now, below the old peak
    meter.hold(150)
    assert meter.peak_extra_bytes() == 450  # 300 + 150, without the freed 400


def test_sync_config_rejects_negative_prefetch() -> None:
    """A negative prefetch bucket is rejected with the field named."""
    with pytest.raises(ValueError, match="prefetch_bytes=-1"):
        SyncConfig(prefetch_bytes=-1)
