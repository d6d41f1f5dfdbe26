"""`fsdp-vllm-sync-check` turns any unreadable input into one line on stderr and exit 2 (never a traceback, never
exit 1, which means "the engine would reject the sync"): a malformed or unreadable accelerate config, a config.json
that is not JSON or not an object, a truncated weights file, a model path that is a file."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from fsdp_sync._demo.models import build_tiny_checkpoint
from fsdp_sync.dry_run import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FSDP1 = {
    "distributed_type": "FSDP",
    "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_use_orig_params": False},
    "mixed_precision": "bf16",
}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


def _yaml(text: str) -> Callable[[Path], Path]:
    def write(tmp_path: Path) -> Path:
        path = tmp_path / "fsdp1.yaml"
        path.write_text(text)
        return path

    return write


# (id, the config file's text, what the one line says)
CONFIGS = [
    ("malformed-yaml", "fsdp_config: [unclosed\n", "cannot be read as YAML: while parsing a flow sequence"),
    ("not-a-mapping", "- a\n- b\n", "holds a YAML list, not a mapping"),
    ("fsdp-config-a-list", "fsdp_config: [a, b]\n", "fsdp_config holds a list, not a mapping"),
    ("no-fsdp-config", "mixed_precision: bf16\n", "has no fsdp_config section"),
    ("bad-version", yaml.safe_dump({**FSDP1, "fsdp_config": {"fsdp_version": "two"}}), "fsdp_version 'two'"),
    (
        "bad-layer-classes",
        yaml.safe_dump({**FSDP1, "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": 3}}),
        "fsdp_transformer_layer_cls_to_wrap 3",
    ),
    ("bad-mixed-precision", yaml.safe_dump({**FSDP1, "mixed_precision": "fp8"}), "mixed_precision 'fp8'"),
]


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp-vllm-sync-check: error: "), captured.err
    assert "Traceback" not in captured.out + captured.err
    return lines[0]


@pytest.mark.parametrize("text, says", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_an_unreadable_accelerate_config_is_one_line(
    qwen2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    config = _yaml(text)(tmp_path)
    line = _one_line_exit_2(capsys, [str(qwen2), "--accelerate-config", str(config), "--compare-fsdp2"])
    assert f"--accelerate-config {config}: " in line and says in line, line


def test_a_config_that_is_not_utf8_is_one_line(qwen2: Path, tmp_path: Path, capsys) -> None:
    config = tmp_path / "fsdp1.yaml"
    config.write_bytes(b"\xff\xfe\x00garbage")
    line = _one_line_exit_2(capsys, [str(qwen2), "--accelerate-config", str(config), "--compare-fsdp2"])
    assert "cannot be read as YAML" in line


def _model_copy(qwen2: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    copy.mkdir()
    for f in qwen2.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


@pytest.mark.parametrize("compare", [False, True], ids=["check", "compare-fsdp2"])
@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda d: (d / "config.json").write_text("{not json"), "config.json cannot be read as JSON"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json holds a JSON list, not an object"),
        (
            lambda d: (d / "config.json").write_text('{"model_type": "no-such-family"}'),
            "cannot build a causal LM from",
        ),
    ],
    ids=["config-not-json", "config-a-list", "config-unknown-family"],
)
def test_an_unreadable_model_directory_is_one_line(
    qwen2: Path, tmp_path: Path, capsys, damage: Callable[[Path], object], says: str, compare: bool
) -> None:
    model = _model_copy(qwen2, tmp_path)
    damage(model)
    argv = [str(model), "--backend", "plain"]
    if compare:
        argv = [str(model), "--accelerate-config", str(_yaml(yaml.safe_dump(FSDP1))(tmp_path)), "--compare-fsdp2"]
    line = _one_line_exit_2(capsys, argv)
    assert says in line, line


def test_a_truncated_weights_file_is_one_line(qwen2: Path, tmp_path: Path, capsys) -> None:
    """(The FSDP2 comparison reads no weights: only the check itself has them as input.)"""
    model = _model_copy(qwen2, tmp_path)
    for f in model.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:20])
    line = _one_line_exit_2(capsys, [str(model), "--backend", "plain"])
    assert "cannot read the weight files' headers" in line, line


def test_a_model_path_that_is_a_file_is_one_line(qwen2: Path, capsys) -> None:
    line = _one_line_exit_2(capsys, [str(qwen2 / "config.json"), "--backend", "plain"])
    assert "config.json" in line


def test_the_console_script_prints_one_line_for_the_reported_yaml(qwen2: Path, tmp_path: Path) -> None:
    """The report's reproduction, as a user runs it: a separate process, stderr whole (it was exit 1 and a 62-line
    `[rank0]:` traceback)."""
    config = _yaml("fsdp_config: [unclosed\n")(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_sync.dry_run", str(qwen2), "--accelerate-config", str(config), "--compare-fsdp2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"fsdp-vllm-sync-check: error: --accelerate-config {config}: cannot be read as YAML")
    assert "line 1, column 14" in lines[0], lines[0]
