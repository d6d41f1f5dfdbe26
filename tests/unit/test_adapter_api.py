"""Adapter syncs, pure parts: PEFT names to the names vLLM parses, what vLLM cannot serve (refused with the reason),
the rank the engine is started with, and TRL's generate calls made to ask for the adapter."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.compat.lora_api import LoRALimits, adapter_refusals, adapter_tensor_name, peft_adapter_config
from fsdp_sync.compat.trl_adapter import ask_for_adapter, lora_rank_for_engine, peft_rank
from fsdp_sync.config import SyncConfig

LIMITS = LoRALimits(8, frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}), torch.float32)


def test_adapter_tensor_names_drop_the_adapter_name_and_keep_the_peft_root() -> None:
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert adapter_tensor_name(name, "default") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapter_tensor_name(name, "other") is None
    assert adapter_tensor_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "default") is None
    assert adapter_tensor_name("base_model.model.lm_head.lora_magnitude_vector.default.weight", "default") is None


def _config(**changes: object) -> dict:
    from peft import LoraConfig

    return {**LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"]).to_dict(), **changes}


def test_a_plain_lora_adapter_is_servable() -> None:
    assert adapter_refusals(_config(), LIMITS, {"q_proj", "v_proj"}) == []


@pytest.mark.parametrize(
    ("changes", "targeted", "says"),
    [
        ({"use_dora": True}, {"q_proj"}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, {"q_proj"}, "modules_to_save"),
        ({"r": 16}, {"q_proj"}, "max_lora_rank 8"),
        ({"rank_pattern": {"q_proj": 32}}, {"q_proj"}, "rank 32"),
        ({}, {"q_proj", "conv1d"}, "target modules ['conv1d']"),
        ({"bias": "all"}, {"q_proj"}, "bias"),
    ],
)
def test_what_vllm_cannot_serve_is_refused_with_the_reason(changes: dict, targeted: set, says: str) -> None:
    reasons = adapter_refusals(_config(**changes), LIMITS, targeted)
    assert any(says in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("server", "fix"),
    [
        (True, "rank 12 is above the server's max_lora_rank 8: restart the server with --max-lora-rank 16"),
        (False, "rank 12 is above the engine's max_lora_rank 8: start the engine with max_lora_rank=16"),
        (None, "rank 12 is above max_lora_rank 8: start the engine with max_lora_rank=16 (a server: --max-lora-rank 16)"),
    ],
    ids=["server", "in-process", "unknown"],
)  # fmt: skip
def test_a_rank_above_the_engines_names_the_setting_and_value_that_fix_it(server: bool | None, fix: str) -> None:
    """Issue 49: not only "use merged syncs": the flag (a server) or argument (`vllm.LLM`), at the smallest value
    vLLM accepts that holds the adapter's largest rank (12 -> 16)."""
    reasons = adapter_refusals(_config(rank_pattern={"q_proj": 12}), LIMITS, {"q_proj"}, server=server)
    assert any(fix in r for r in reasons), reasons


def test_the_peft_config_of_a_model_as_a_plain_dict() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    lora = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_config(config), lora)
    name, plain = peft_adapter_config(model)
    assert name == "default" and plain["r"] == 4 and plain["target_modules"] == ["q_proj"]
    assert plain["peft_type"] == "LORA"
    with pytest.raises(ValueError, match="not a PEFT model"):
        peft_adapter_config(AutoModelForCausalLM.from_config(config))


def test_the_engine_rank_is_the_smallest_vllm_accepts() -> None:
    from peft import LoraConfig

    assert lora_rank_for_engine(4) == 8 and lora_rank_for_engine(8) == 8 and lora_rank_for_engine(9) == 16
    assert peft_rank(LoraConfig(r=4, rank_pattern={"v_proj": 12})) == 12
    assert peft_rank(None) is None
    with pytest.raises(ValueError, match="above every max_lora_rank"):
        lora_rank_for_engine(4096)


def test_generation_asks_for_the_current_adapter_where_the_caller_names_none() -> None:
    """What TRL's `VLLMGeneration.generate` calls (`llm.generate(prompts, sampling_params=..., use_tqdm=False)`)
    gets the adapter; a caller's own request is kept; wrapping twice wraps once."""

    class Engine:
        def __init__(self) -> None:
            self.calls: list[object] = []

        def generate(self, prompts: object, sampling_params: object = None, **kwargs: object) -> object:
            self.calls.append(kwargs.get("lora_request"))
            return prompts

    engine = Engine()
    current = ["v1"]
    ask_for_adapter(engine, lambda: current[0])
    ask_for_adapter(engine, lambda: "twice")
    engine.generate(["p"], sampling_params=None, use_tqdm=False)
    current[0] = "v2"
    engine.generate(["p"])
    engine.generate(["p"], lora_request="mine")
    assert engine.calls == ["v1", "v2", "mine"]


def test_adapter_and_sparse_options_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="adapter=True"):
        SyncConfig(adapter=True, sparse=True)
    assert SyncConfig().adapter is None


def test_a_server_reports_its_lora_rank() -> None:
    """`/server_info` with a LoRA config gives the rank adapter syncs check against."""
    from fsdp_sync.compat.server_api import parse_server_info

    answer = {"vllm_config": {"model_config": {"model": "/m", "dtype": "float32"}, "lora_config": {"max_lora_rank": 8}}}
    assert parse_server_info(answer).max_lora_rank == 8
    del answer["vllm_config"]["lora_config"]
    assert parse_server_info(answer).max_lora_rank is None


def test_the_api_server_serves_exactly_the_last_k_published_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """After each adapter publish the API server's names (`lora_requests`, what `/v1/models` lists and what a request
    may name) are the last K published: older in-memory versions are dropped, a path-loaded adapter is kept, a
    re-published name gets a fresh id; a push of an adapter's tensors (staged) serves nothing. Regression (issue 40):
    every name ever resolved stayed, and naming an unloaded one killed the engine; (issue 47): a pushed version was
    served before its sync was verified."""
    from vllm.lora.request import LoRARequest
    from vllm.utils.counter import AtomicCounter

    from fsdp_sync.compat import lora_patches
    from fsdp_sync.compat.lora_api import IN_MEMORY_PATH

    monkeypatch.setattr(lora_patches, "_API_SERVED", [])
    monkeypatch.setattr(lora_patches, "_API_EVER", set())
    monkeypatch.setattr(lora_patches, "_SERVING_MODELS", lora_patches.weakref.WeakSet())
    on_disk = LoRARequest(lora_name="mine", lora_int_id=1, lora_path="/adapters/mine")
    models = _ServingModels({"mine": on_disk}, AtomicCounter(1))
    lora_patches._SERVING_MODELS.add(models)
    for version in (1, 2, 3):
        pushed = {"names": ["x"], "adapter": {"id": version, "name": f"fvs-v{version}", "config": {}}}
        assert lora_patches._published_adapter_names(pushed) == []
        info = {"names": [], "publish": f"fvs-v{version}", "fresh": version == 1}
        ((name, fresh),) = lora_patches._published_adapter_names([info] if version == 2 else info)
        assert fresh == (version == 1)
        lora_patches._serve_published(name, keep=2, fresh=fresh)
    assert list(models.lora_requests) == ["mine", "fvs-v2", "fvs-v3"]
    assert models.lora_requests["fvs-v3"].lora_path == f"{IN_MEMORY_PATH}/fvs-v3"
    old_id = models.lora_requests["fvs-v3"].lora_int_id
    lora_patches._serve_published("fvs-v3", keep=2)
    assert models.lora_requests["fvs-v3"].lora_int_id != old_id
    assert lora_patches._API_SERVED == ["fvs-v2", "fvs-v3"]
    assert lora_patches._published_adapter_names({"names": ["x"]}) == []
    # another trainer's first publish: the versions served before are retired, a path-loaded adapter is kept
    lora_patches._serve_published("fvs-v1", keep=2, fresh=True)
    assert list(models.lora_requests) == ["mine", "fvs-v1"] and lora_patches._API_SERVED == ["fvs-v1"]


def test_a_name_published_again_drops_the_prefix_cache_before_the_workers_serve_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM keys its prefix cache by the adapter's name and path: before a name published earlier in the server's
    life is published again (a trainer restarted from v1), the API server drops the cache, then forwards the publish;
    a push of an adapter's tensors (staged) and a first publish drop nothing. Regression (issue 47): a reloaded
    version served 32 prompt tokens cached under the earlier contents."""
    import asyncio
    from types import SimpleNamespace

    from vllm.v1.engine.async_llm import AsyncLLM

    from fsdp_sync.compat import lora_patches

    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:  # its module before vLLM moved it (as `lora_patches.guard_served_adapters` imports it)
        from vllm.entrypoints.openai.serving_models import OpenAIServingModels  # type: ignore[no-redef]

    calls: list[str] = []

    async def original_update(self: object, request: object) -> None:
        calls.append("update")

    monkeypatch.setattr(AsyncLLM, "update_weights", original_update, raising=False)
    monkeypatch.setattr(OpenAIServingModels, "__init__", OpenAIServingModels.__init__)
    monkeypatch.setattr(lora_patches, "_API_SERVED", [])
    monkeypatch.setattr(lora_patches, "_API_EVER", set())
    monkeypatch.setattr(lora_patches, "_SERVING_MODELS", lora_patches.weakref.WeakSet())
    monkeypatch.setenv(lora_patches.ADAPTER_VERSIONS_ENV, "2")
    lora_patches.guard_served_adapters()

    class Engine:
        async def reset_prefix_cache(self) -> bool:
            calls.append("reset")
            return True

    def publish(name: str, **extra: object) -> list[str]:
        calls.clear()
        info = {"names": [], "dtype_names": [], "shapes": [], **extra} if extra else {"names": [], "publish": name}
        asyncio.run(AsyncLLM.update_weights(Engine(), SimpleNamespace(update_info=info)))  # type: ignore[arg-type]
        return list(calls)

    assert publish("fvs-v1", adapter={"id": 1, "name": "fvs-v1", "config": {}}) == ["update"]  # staged: nothing
    assert publish("fvs-v1") == ["update"]  # first publish of the name
    assert publish("fvs-v2") == ["update"]
    assert publish("fvs-v1") == ["reset", "update"]  # the name again, with other contents: the cache goes first
    assert lora_patches._API_SERVED == ["fvs-v2", "fvs-v1"]


def test_a_worker_serves_a_pushed_adapter_only_once_it_is_published(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker side: a pushed adapter is staged (verify reads it by name; no request is served from it), published
    on the trainer's word (the oldest beyond K retired), and a publish of a version never pushed changes nothing."""
    from fsdp_sync.compat import lora_patches

    monkeypatch.setattr(lora_patches, "_SERVED", lora_patches.OrderedDict())
    monkeypatch.setattr(lora_patches, "_STAGED", {})
    monkeypatch.setenv(lora_patches.ADAPTER_VERSIONS_ENV, "2")
    for version in (1, 2, 3):
        lora_patches._STAGED.clear()
        lora_patches._STAGED[f"v{version}"] = f"lora{version}"  # what `stash_adapter` keeps, built and checked
        assert lora_patches.kept_adapter(f"v{version}") == f"lora{version}"  # verify reads the staged version
        assert f"v{version}" not in lora_patches.served_adapters()
        lora_patches.publish_adapter(f"v{version}")
        assert lora_patches.served_adapters()[-1] == f"v{version}" and not lora_patches._STAGED
    assert lora_patches.served_adapters() == ["v2", "v3"]
    with pytest.raises(KeyError, match="no adapter v9"):
        lora_patches.publish_adapter("v9")
    assert lora_patches.served_adapters() == ["v2", "v3"]
    lora_patches._STAGED["v1"] = "another trainer's v1"
    lora_patches.publish_adapter("v1", fresh=True)  # another trainer's first publish retires what was served
    assert lora_patches.served_adapters() == ["v1"] and lora_patches.kept_adapter("v1") == "another trainer's v1"


class _ServingModels:
    """What `_serve_published` uses of vLLM's `OpenAIServingModels`."""

    def __init__(self, lora_requests: dict, lora_id_counter: object) -> None:
        self.lora_requests = lora_requests
        self.lora_id_counter = lora_id_counter


def test_kept_versions_are_bounded_by_the_servers_lora_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from fsdp_sync.compat.lora_patches import ADAPTER_VERSIONS_ENV, kept_versions, version_refusal

    monkeypatch.delenv(ADAPTER_VERSIONS_ENV, raising=False)
    assert kept_versions() == 1
    monkeypatch.setenv(ADAPTER_VERSIONS_ENV, "3")
    assert kept_versions() == 3
    assert version_refusal(3, SimpleNamespace(max_loras=1, max_cpu_loras=3)) is None
    refusal = version_refusal(3, SimpleNamespace(max_loras=1, max_cpu_loras=2))
    assert refusal is not None and "max_cpu_loras=2" in refusal and "--max-cpu-loras 3" in refusal
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(ADAPTER_VERSIONS_ENV, bad)
        with pytest.raises(ValueError, match=ADAPTER_VERSIONS_ENV):
            kept_versions()


class _AdapterEngine:
    """An `AdapterWriter` whose engine has LoRA (`limits`) or not (None); it records what it is given."""

    kind = "fake"
    pushes = True
    engine_per_rank = True
    retains_tensors = False
    engine_dtype = torch.float32

    def __init__(self, limits: LoRALimits | None) -> None:
        self.limits = limits

    def lora_limits(self) -> LoRALimits | None:
        return self.limits

    def adapter_transport_refusal(self) -> str | None:
        return None

    def base_checkpoint(self) -> str:
        return "/nonexistent"

    def load_adapter(self, adapter: object) -> None:
        raise AssertionError("nothing is loaded at build time")

    def publish_adapter(self, adapter: object) -> None:
        raise AssertionError("nothing is published at build time")

    def abandon_adapter(self) -> None:
        raise AssertionError("nothing is dropped at build time")

    def adapter_request(self) -> object | None:
        return None

    def adapter_digests(self) -> object:
        raise AssertionError("nothing is verified at build time")


def _tiny_peft(**lora: object) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    adapter = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj"], **lora)
    return get_peft_model(AutoModelForCausalLM.from_config(config), adapter)


def test_adapter_syncs_by_default_where_the_engine_serves_the_adapter_else_merged_with_the_reason(caplog) -> None:
    import logging

    from fsdp_sync.assemble import _adapter_sync
    from fsdp_sync.errors import UnsupportedSetupError
    from fsdp_sync.sync.adapter import AdapterSync

    cpu = torch.device("cpu")
    sync = _adapter_sync(_tiny_peft(), _AdapterEngine(LIMITS), SyncConfig(), cpu, None)
    assert isinstance(sync, AdapterSync) and sync.plan is not None
    # Reported as what runs: the adapter's pieces exchanged, into the engine's LoRA manager (nothing reloaded).
    assert (sync.strategy, sync.writer_kind) == ("adapter-pieces", "colocate:lora_manager")
    with caplog.at_level(logging.INFO, logger="fsdp_sync.assemble"):
        assert _adapter_sync(_tiny_peft(), _AdapterEngine(None), SyncConfig(), cpu, None) is None
        assert _adapter_sync(_tiny_peft(use_dora=True), _AdapterEngine(LIMITS), SyncConfig(), cpu, None) is None
    assert "started without LoRA" in caplog.text and "DoRA" in caplog.text
    with pytest.raises(UnsupportedSetupError, match="SyncConfig\\(adapter=False\\)"):
        _adapter_sync(_tiny_peft(use_dora=True), _AdapterEngine(LIMITS), SyncConfig(adapter=True), cpu, None)


def test_a_server_whose_transport_cannot_carry_an_adapter_falls_back_to_merged_syncs(monkeypatch, caplog) -> None:
    """`adapter=None` on an NCCL server started with LoRA: merged syncs, the reason logged (no first push that fails);
    `adapter=True` there is refused before anything is written, with the same reason."""
    import logging

    from fsdp_sync.assemble import _adapter_sync
    from fsdp_sync.compat.server_api import ServerInfo
    from fsdp_sync.errors import UnsupportedSetupError
    from fsdp_sync.writers import server as server_writer

    monkeypatch.setattr(server_writer.torch.cuda, "is_available", lambda: True)  # lets the nccl transport be chosen
    info = ServerInfo(model="/srv/m", dtype=torch.float32, weight_transfer_backend="nccl", served_name="m",
                      max_lora_rank=8)  # fmt: skip
    writer = server_writer.ServerWriter(None, info, group_port=1, buffer_bytes=1024, timeout_s=5)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="fsdp_sync.assemble"):
        assert _adapter_sync(_tiny_peft(), writer, SyncConfig(), cpu, None) is None
    assert "merged syncs, not adapter syncs" in caplog.text and "'nccl'" in caplog.text
    with pytest.raises(UnsupportedSetupError, match="uses 'nccl'"):
        _adapter_sync(_tiny_peft(), writer, SyncConfig(adapter=True), cpu, None)


def test_adapter_true_refusals_name_the_change_that_fixes_them() -> None:
    """Issue 49: each refusal of `adapter=True` says what to change, then the merged fallback: a server whose
    `--max-lora-rank` is too low (the flag and value), a server without LoRA (both flags), a model without PEFT
    (drop `adapter=True`, or give the trainer `peft_config=`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_sync.assemble import _adapter_sync
    from fsdp_sync.compat.server_api import ServerInfo
    from fsdp_sync.errors import UnsupportedSetupError
    from fsdp_sync.writers import server as server_writer

    cpu = torch.device("cpu")

    def refusal(model: torch.nn.Module, writer: object) -> str:
        with pytest.raises(UnsupportedSetupError) as raised:
            _adapter_sync(model, writer, SyncConfig(adapter=True), cpu, None)
        message = str(raised.value)
        assert "use merged syncs instead: SyncConfig(adapter=False)" in message and "Nothing was written" in message
        return message

    def gloo_server(max_lora_rank: int | None) -> object:
        info = ServerInfo(model="/srv/m", dtype=torch.float32, weight_transfer_backend="gloo", served_name="m",
                          max_lora_rank=max_lora_rank)  # fmt: skip
        return server_writer.ServerWriter(None, info, group_port=1, buffer_bytes=1024, timeout_s=5)

    rank_12 = _tiny_peft(rank_pattern={"q_proj": 12})
    assert "rank 12 is above the server's max_lora_rank 8: restart the server with --max-lora-rank 16" in refusal(
        rank_12, gloo_server(8)
    )
    assert "started without LoRA: restart the server with --enable-lora --max-lora-rank 16" in refusal(
        rank_12, gloo_server(None)
    )
    assert "start the engine with max_lora_rank=16" in refusal(rank_12, _AdapterEngine(LIMITS))  # colocated
    assert "enable_lora=True, max_lora_rank=8" in refusal(_tiny_peft(), _AdapterEngine(None))

    config = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    message = refusal(AutoModelForCausalLM.from_config(config), _AdapterEngine(LIMITS))
    assert "the model has no PEFT adapter: drop adapter=True" in message and "peft_config=" in message


def test_the_base_check_reads_only_each_pieces_rows_compares_exactly_and_closes_its_files(
    monkeypatch, tmp_path
) -> None:
    import safetensors
    from safetensors.torch import save_file

    from fsdp_sync.gather.base import Piece
    from fsdp_sync.sync.adapter import AdapterPlan, base_mismatches

    weight = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    save_file({"w.weight": weight, "n.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    real, opened, reads = safetensors.safe_open, [], []

    class Recorded:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self) -> Recorded:
            self.inner.__enter__()
            opened.append(self)
            return self

        def __exit__(self, *exc: object) -> None:
            opened.remove(self)
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            raise AssertionError(f"the whole of {name} was read")

        def get_slice(self, name: str) -> object:
            view = self.inner.get_slice(name)

            class Rows:
                def get_shape(self) -> list[int]:
                    return view.get_shape()

                def __getitem__(self, rows: slice) -> torch.Tensor:
                    reads.append((name, rows.start, rows.stop))
                    return view[rows]

            return Rows()

    monkeypatch.setattr(safetensors, "safe_open", Recorded)
    plan = AdapterPlan((), {}, {"w": "w.weight", "n": "n.weight"}, {}, "default", 0)
    # Elements 13..21 of the flattened weight (rows 3 to 5), and the whole norm.
    pieces = [Piece("w", weight.reshape(-1)[13:22].clone(), 13), Piece("n", torch.ones(4), 0)]
    assert base_mismatches(plan, pieces, str(tmp_path)) == []
    assert reads == [("w.weight", 3, 6), ("n.weight", 0, 4)] and opened == []
    changed = weight.reshape(-1)[13:22].clone()
    changed[4] += 1e-6 * changed[4]  # one element, by one ulp's order: a digest or torch.equal, not allclose
    found = base_mismatches(plan, [Piece("w", changed, 13)], str(tmp_path))
    assert found == ["w.weight: differs from the trainer's frozen base"]
    assert opened == []


def test_every_option_applies_to_adapter_syncs_or_is_refused(caplog) -> None:
    """`sparse`: refused with adapter=True, merged syncs with adapter=None (the reason logged); `verify` applies
    (the engine's adapter read back and compared, `test_adapter_verify_*`); `check_finite` checks the adapter's own
    pieces."""
    import logging

    from fsdp_sync.assemble import _adapter_sync
    from fsdp_sync.errors import NonFiniteWeightsError
    from fsdp_sync.gather.base import HeldPieces
    from fsdp_sync.sync.adapter import AdapterSync, _check_finite
    from fsdp_sync.sync.pieces import PieceExchange

    with pytest.raises(ValueError, match="adapter=True pushes the whole adapter"):
        SyncConfig(adapter=True, sparse=True)
    SyncConfig(adapter=True, verify=True)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="fsdp_sync.assemble"):
        assert isinstance(_adapter_sync(_tiny_peft(), _AdapterEngine(LIMITS), SyncConfig(verify=True), cpu, None), AdapterSync)
        assert _adapter_sync(_tiny_peft(), _AdapterEngine(LIMITS), SyncConfig(sparse=True), cpu, None) is None
    assert "sparse=True" in caplog.text
    values = {"a.lora_A": torch.ones(3), "a.lora_B": torch.tensor([0.0, 0.0, 1.0, 2.0])}

    def held(names):  # this rank holds a.lora_A whole and a.lora_B's last two elements
        return HeldPieces(((0, 0, 3), (1, 2, 2)), lambda: [values["a.lora_A"], values["a.lora_B"][2:]])

    exchange = PieceExchange(["a.lora_A", "a.lora_B"], [(3,), (4,)], [torch.float32] * 2, held)
    _check_finite(exchange, exchange.pack())
    values["a.lora_B"][3] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=r"1 adapter weight\(s\) on this rank: a.lora_B;"):
        _check_finite(exchange, exchange.pack())
