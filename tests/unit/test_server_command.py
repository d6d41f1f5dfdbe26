"""The server command a run needs (`fsdp_sync.server_command`): exact outputs for a few configs, the refusals, the
CPU binding, and the flags parsed by the installed vLLM's own API-server parser (issue 49)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fsdp_sync.server_command import (
    CPU_SERVER_MODULE,
    ServerCommand,
    cpu_binding,
    kept_versions_for,
    lora_rank_of,
    main,
    server_command,
)

pytestmark = pytest.mark.unit

PY = ".venv/bin/python"
GLOO = json.dumps({"backend": "gloo"})
NCCL = json.dumps({"backend": "nccl"})
LOGPROBS = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]


def _vllm() -> bool:
    try:
        import vllm.config.lora  # noqa: F401
    except ImportError:
        return False
    return True


needs_vllm = pytest.mark.skipif(not _vllm(), reason="vLLM is not importable here (the LoRA rank is vLLM's choice)")


def test_a_cpu_server_for_merged_syncs() -> None:
    """docs/server.md's first command: one worker, the gloo backend, TRL's logprobs flags."""
    cmd = server_command("DIR", device="cpu", host="127.0.0.1", python=PY)
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert cmd.argv == [
        PY, "-m", CPU_SERVER_MODULE, "--model", "DIR", "--host", "127.0.0.1", "--port", "8000",
        "--dtype", "bfloat16", "--enforce-eager", "--weight-transfer-config", GLOO, *LOGPROBS,
    ]  # fmt: skip
    assert cmd.shell() == (
        "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m vllm.entrypoints.openai.api_server "
        "--model DIR --host 127.0.0.1 --port 8000 --dtype bfloat16 --enforce-eager "
        """--weight-transfer-config '{"backend": "gloo"}' --logprobs-mode processed_logprobs --max-logprobs -1"""
    )


@needs_vllm
def test_a_tensor_parallel_cpu_lora_server() -> None:
    """Two workers bound to a core each, LoRA for an r=16 adapter, 2 versions kept."""
    cmd = server_command(
        "DIR", device="cpu", host="127.0.0.1", python=PY, dtype="float32", tensor_parallel_size=2, adapter=True,
        lora_rank=16, kept_versions=2, cpus=[0, 1],
    )  # fmt: skip
    assert cmd.env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "FSDP_VLLM_SYNC_ADAPTER_VERSIONS": "2",
    }
    assert cmd.argv == [
        PY, "-m", CPU_SERVER_MODULE, "--model", "DIR", "--host", "127.0.0.1", "--port", "8000",
        "--dtype", "float32", "--enforce-eager", "--weight-transfer-config", GLOO, *LOGPROBS,
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "1", "--max-cpu-loras", "2",
        "--tensor-parallel-size", "2",
    ]  # fmt: skip
    assert cmd.shell(width=120) == (
        "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND='0|1' "
        "FSDP_VLLM_SYNC_ADAPTER_VERSIONS=2 \\\n"
        "    .venv/bin/python -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port 8000 "
        "--dtype float32 \\\n"
        """    --enforce-eager --weight-transfer-config '{"backend": "gloo"}' --logprobs-mode processed_logprobs \\\n"""
        "    --max-logprobs -1 --enable-lora --max-lora-rank 16 --max-loras 1 --max-cpu-loras 2 "
        "--tensor-parallel-size 2"
    )


def test_a_gpu_server_for_merged_syncs_uses_nccl() -> None:
    cmd = server_command("Qwen/Qwen2.5-7B", device="cuda", cuda_devices="0")
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_SERVER_DEV_MODE": "1"}
    assert cmd.argv == [
        "vllm", "serve", "Qwen/Qwen2.5-7B", "--port", "8000", "--weight-transfer-config", NCCL, *LOGPROBS,
    ]  # fmt: skip


def test_a_gpu_server_for_sparse_syncs_uses_gloo_and_the_sparse_switch() -> None:
    cmd = server_command("M", device="cuda", tensor_parallel_size=2, dtype="bfloat16", max_model_len=4096)
    assert cmd.argv[-2:] == ["--tensor-parallel-size", "2"] and NCCL in cmd.argv
    cmd = server_command("M", device="cuda", sparse=True)
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "FSDP_VLLM_SYNC_SPARSE": "1"}
    assert cmd.argv == ["vllm", "serve", "M", "--port", "8000", "--weight-transfer-config", GLOO, *LOGPROBS]


@needs_vllm
def test_a_data_parallel_gpu_lora_server_for_the_async_trainer() -> None:
    """TRL's default max_staleness (4): 5 versions; rank 12 rounded up to vLLM's 16; one API server process (vLLM
    would start one per replica, and only the one that took a push would know the new name)."""
    cmd = server_command(
        "M", device="cuda", data_parallel_size=2, adapter=True, lora_rank=12, kept_versions=kept_versions_for()
    )
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "FSDP_VLLM_SYNC_ADAPTER_VERSIONS": "5"}
    assert cmd.argv == [
        "vllm", "serve", "M", "--port", "8000", "--weight-transfer-config", GLOO, *LOGPROBS,
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "1", "--max-cpu-loras", "5",
        "--data-parallel-size", "2", "--api-server-count", "1",
    ]  # fmt: skip


@needs_vllm
def test_one_kept_version_sets_no_variable() -> None:
    cmd = server_command("M", device="cuda", adapter=True, lora_rank=8)
    assert "FSDP_VLLM_SYNC_ADAPTER_VERSIONS" not in cmd.env
    assert cmd.argv[-7:] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras", "1"]


def test_the_shell_quotes_values_and_keeps_names_bare() -> None:
    cmd = ServerCommand(env={"A": "0|1", "B": "x y"}, argv=["prog", "--opt", "it's", "--flag"])
    assert cmd.shell() == "A='0|1' B='x y' prog --opt 'it'\"'\"'s' --flag"
    assert cmd.shell(width=20) == "A='0|1' B='x y' \\\n    prog \\\n    --opt 'it'\"'\"'s' \\\n    --flag"


@pytest.mark.parametrize(
    ("workers", "cpus", "expected"),
    [
        (2, [0, 1], "0|1"),
        (2, range(16), "0-7|8-15"),
        (3, range(8), "0-2|3-5|6-7"),
        (2, [0, 1, 2, 3, 8, 9, 10, 11], "0-3|8-11"),
        (2, [6, 0, 4, 2], "0,2|4,6"),
        (1, [5], "5"),
    ],
)
def test_cpu_binding_gives_each_worker_its_own_cpus(workers: int, cpus, expected: str) -> None:
    assert cpu_binding(workers, cpus) == expected


def test_cpu_binding_refuses_fewer_cpus_than_workers() -> None:
    with pytest.raises(ValueError, match=r"4 CPU workers need at least 4 CPUs"):
        cpu_binding(4, [0, 1])


def test_a_multi_worker_cpu_server_binds_this_process_cpus_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cmd = server_command("DIR", device="cpu", data_parallel_size=2)
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"device": "tpu"}, r"device='tpu'; one of \['cpu', 'cuda'\]"),
        ({"adapter": True, "sparse": True, "lora_rank": 8}, "sparse=True applies to merged syncs only"),
        ({"lora_rank": 8}, "pass adapter=True too"),
        ({"kept_versions": 3}, "pass adapter=True too"),
        ({"adapter": True}, r"needs lora_rank"),
        ({"adapter": True, "lora_rank": 0}, r"lora_rank=0; must be 1 or more"),
        ({"device": "cpu", "backend": "nccl"}, "cannot serve a CPU server"),
        ({"backend": "nccl", "sparse": True}, "cannot serve sparse syncs: use backend='gloo'"),
        ({"backend": "ipc"}, r"fsdp-vllm-sync drives \['gloo', 'nccl'\]"),
        ({"device": "cpu", "dtype": "float8"}, "vLLM's CPU build computes in"),
        ({"device": "cpu", "cpus": [0, 1]}, "more than one worker only"),
        ({"device": "cpu", "cuda_devices": "0"}, "for a GPU server"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0; must be 1 or more"),
    ],
)
def test_a_choice_the_server_cannot_serve_or_would_ignore_is_refused(kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        server_command("M", **kwargs)


def test_lora_rank_of_reads_r_and_rank_pattern() -> None:
    from peft import LoraConfig

    assert lora_rank_of(LoraConfig(r=8, target_modules=["q_proj"])) == 8
    assert lora_rank_of(LoraConfig(r=8, rank_pattern={"v_proj": 32}, target_modules=["q_proj", "v_proj"])) == 32
    with pytest.raises(ValueError, match="no LoRA rank"):
        lora_rank_of(SimpleNamespace(r=None))


def test_kept_versions_for_the_async_trainer() -> None:
    """TRL 1.16's AsyncGRPOConfig.max_staleness default, read from TRL where it is installed."""
    assert kept_versions_for() == 5 and kept_versions_for(1) == 2 and kept_versions_for(0) == 1
    config = pytest.importorskip("trl.experimental.async_grpo.async_grpo_config")
    import dataclasses

    default = {f.name: f.default for f in dataclasses.fields(config.AsyncGRPOConfig)}["max_staleness"]
    assert kept_versions_for() == default + 1


def test_the_environment_names_are_the_server_sides() -> None:
    from fsdp_sync import server_command as module
    from fsdp_sync.compat.lora_patches import ADAPTER_VERSIONS_ENV
    from fsdp_sync.transfer.plugin import SPARSE_ENV

    assert (module._ADAPTER_VERSIONS, module._SPARSE) == (ADAPTER_VERSIONS_ENV, SPARSE_ENV)


def test_the_module_imports_neither_vllm_nor_torch() -> None:
    code = "import sys, fsdp_sync.server_command; print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# --- the command line ---


def test_the_cli_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "DIR", "--device", "cpu", "--host", "127.0.0.1", "--python", PY]) == 0
    expected = server_command("DIR", device="cpu", host="127.0.0.1", python=PY).shell(width=120)
    assert capsys.readouterr().out == expected + "\n"


@needs_vllm
def test_the_cli_keeps_max_staleness_plus_one_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "M", "--device", "cuda", "--adapter", "--lora-r", "16", "--max-staleness", "4"]) == 0
    out = capsys.readouterr().out
    assert "FSDP_VLLM_SYNC_ADAPTER_VERSIONS=5" in out and "--max-cpu-loras 5" in out, out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lora-r", "8"], "--lora-r: only for a LoRA server (adapter syncs): add --adapter"),
        (["--max-staleness", "4"], "--max-staleness: only for a LoRA server (adapter syncs): add --adapter"),
        (["--adapter"], "--adapter needs --lora-r R"),
        (["--device", "cpu", "--tp", "4", "--cpus", "0-1"], "4 CPU workers need at least 4 CPUs"),
        (["--device", "cpu", "--dp", "2", "--cpus", "0-x"], "--cpus '0-x': give CPU ids and ranges"),
        (["--device", "cpu", "--backend", "nccl"], "cannot serve a CPU server"),
    ],
)
def test_the_cli_refuses_in_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "M", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m fsdp_sync.server_command: error: ") and says in err[0], err


# --- vLLM's own parser ---


def _vllm_parse(argv: list[str]):  # type: ignore[no-untyped-def]
    """`argv` as the installed vLLM's API server reads it (the CPU server module and `vllm serve` both build their
    parser with `make_arg_parser`), checked as it checks it before loading anything."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:  # the module before vLLM moved it (0.28-0.31)
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[1:3] == ["-m", CPU_SERVER_MODULE]:
        words = argv[3:]
    else:
        assert argv[:2] == ["vllm", "serve"], argv
        words = argv[2:]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(words)
    validate_parsed_serve_args(args)
    return args


CONFIGS = {
    "cpu": {"device": "cpu", "host": "127.0.0.1"},
    "cpu-tp2-sparse": {"device": "cpu", "tensor_parallel_size": 2, "sparse": True, "cpus": [0, 1]},
    "cpu-dp2-lora": {"device": "cpu", "data_parallel_size": 2, "adapter": True, "lora_rank": 16, "kept_versions": 2,
                     "cpus": [0, 1], "dtype": "float32"},
    "cuda": {"device": "cuda", "dtype": "bfloat16", "max_model_len": 4096},
    "cuda-dp2-lora": {"device": "cuda", "data_parallel_size": 2, "adapter": True, "lora_rank": 40,
                      "kept_versions": 5},
}  # fmt: skip


@needs_vllm
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_vllm_accepts_the_flags(name: str) -> None:
    from vllm.config.lora import LoRAConfig

    from fsdp_sync.compat.lora_patches import version_refusal

    config = CONFIGS[name]
    cmd = server_command("DIR", python=PY, **config)
    args = _vllm_parse(cmd.argv)
    assert (args.model if config["device"] == "cpu" else args.model_tag) == "DIR"
    expected = "gloo" if config["device"] == "cpu" or config.get("adapter") or config.get("sparse") else "nccl"
    assert args.weight_transfer_config.backend == expected
    assert (args.logprobs_mode, args.max_logprobs) == ("processed_logprobs", -1)
    assert args.tensor_parallel_size == config.get("tensor_parallel_size", 1)
    assert args.data_parallel_size == config.get("data_parallel_size", 1)
    assert bool(args.enable_lora) is bool(config.get("adapter"))
    if config.get("adapter"):
        assert args.max_lora_rank >= config["lora_rank"]
        lora = LoRAConfig(max_lora_rank=args.max_lora_rank, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras)
        assert version_refusal(config["kept_versions"], lora) is None
        # no slot to spare: the smallest cache that keeps them
        fewer = LoRAConfig(max_lora_rank=args.max_lora_rank, max_loras=1, max_cpu_loras=args.max_cpu_loras - 1)
        assert args.max_cpu_loras == 1 or version_refusal(config["kept_versions"], fewer) is not None


def test_what_each_backend_serves_is_what_the_server_writers_transports_declare() -> None:
    """The generator's table of what each backend carries (kept torch-free) against the transports' own
    declarations (`fsdp_sync.writers.server_transports`): one rule, in two places only because of the import."""
    from fsdp_sync import server_command
    from fsdp_sync.writers.server_transports import _TRANSPORTS, SUPPORTED_BACKENDS

    assert set(server_command._SERVES) == set(SUPPORTED_BACKENDS) == set(server_command.BACKENDS)
    for name, transport in _TRANSPORTS.items():
        serves = server_command._SERVES[name]
        assert ("a CPU server" in serves) == (not transport.requires_cuda), name
        assert ("adapter syncs" in serves) == transport.carries_adapters, name
        assert ("sparse syncs" in serves) == transport.carries_patches, name


def test_the_command_from_a_training_scripts_own_objects() -> None:
    """`server_command_for`: the `SyncConfig`, the PEFT config and TRL's async config as a script holds them give the
    same command as the explicit choices (the async trainer's default `max_staleness` keeps 5 versions)."""
    from types import SimpleNamespace

    from peft import LoraConfig

    from fsdp_sync import SyncConfig
    from fsdp_sync.server_command import server_command_for

    lora = LoraConfig(r=8, rank_pattern={"v_proj": 16}, target_modules=["q_proj", "v_proj"])
    async_args = SimpleNamespace(max_staleness=4)
    got = server_command_for("DIR", SyncConfig(adapter=True), peft_config=lora, trainer_args=async_args, device="cpu")
    assert got == server_command("DIR", device="cpu", adapter=True, lora_rank=16, kept_versions=5)
    assert server_command_for("DIR", SyncConfig(sparse=True), device="cpu") == server_command(
        "DIR", device="cpu", sparse=True
    )
    assert server_command_for("DIR", SyncConfig(adapter=True), peft_config=lora, device="cpu").env.get(
        "FSDP_VLLM_SYNC_ADAPTER_VERSIONS"
    ) is None  # GRPOTrainer: one version
    with pytest.raises(ValueError, match="peft_config"):
        server_command_for("DIR", SyncConfig(adapter=True), device="cpu")
