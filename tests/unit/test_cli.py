"""The console scripts' shared plumbing (`fsdp_sync.cli`), their help, and `fsdp-vllm-sync-demo`'s command line
(the dry run's own mistakes are in test_dry_run.py).

Nothing here launches the demo's job: every case ends before it (at argparse, or at a usage error).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fsdp_sync._demo.models import FAMILIES
from fsdp_sync.cli import EXIT_USAGE, UsageError, make_parser, require, run
from fsdp_sync.demo import main as demo_main
from fsdp_sync.dry_run import main as check_main


def test_require_names_every_missing_module_and_its_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what find_spec reports for a module not installed
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(UsageError) as error:
        require({"transformers": "trl", "peft": "peft", "torch": "never-asked"})
    assert str(error.value) == "transformers, peft not installed; install with: pip install 'fsdp-vllm-sync[peft,trl]'"


def test_require_passes_when_everything_is_installed() -> None:
    require({"torch": "unused", "packaging": "unused"})


def test_run_reports_a_usage_error_on_one_line(capsys) -> None:
    def body() -> int:
        raise UsageError("the thing is missing; pass --thing")

    assert run("some-command", body) == EXIT_USAGE
    assert capsys.readouterr().err == "some-command: error: the thing is missing; pass --thing\n"


def test_help_shows_defaults_but_not_none() -> None:
    parser = make_parser("p", "Description.\n\nSecond paragraph, kept as written.")
    parser.add_argument("--count", type=int, default=3, help="how many")
    parser.add_argument("--out", default=None, help="where (default: a temporary directory)")
    text = parser.format_help()
    assert "how many (default: 3)" in text
    assert "(default: None)" not in text
    assert "Description.\n\nSecond paragraph, kept as written." in text


def _exits_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        demo_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_demo_unknown_family_is_a_usage_error(capsys) -> None:
    err = _exits_2(capsys, ["--family", "bert"])
    listed = ", ".join(f"'{name}'" for name in sorted(FAMILIES))
    assert f"argument --family: invalid choice: 'bert' (choose from {listed})" in err


def test_demo_malformed_numbers_are_usage_errors(capsys) -> None:
    assert "argument --steps: '0' is not a positive whole number" in _exits_2(capsys, ["--steps", "0"])
    assert "argument --steps: 'three' is not a positive whole number" in _exits_2(capsys, ["--steps", "three"])
    assert "argument --backend: invalid choice: 'deepspeed'" in _exits_2(capsys, ["--backend", "deepspeed"])


def test_demo_out_that_is_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    afile = tmp_path / "results.txt"
    afile.write_text("")
    assert demo_main(["--out", str(afile)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fsdp-vllm-sync-demo: error: --out {afile}: exists and is not a directory; name a " \
        "directory (it is created if new)\n"


def test_demo_missing_dependency_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert demo_main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdp-vllm-sync-demo: error: vllm not installed; install with: pip install "
                          "'fsdp-vllm-sync[test]'")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            demo_main,
            [
                "--backend {fsdp2,fsdp1,ddp}",
                "how accelerate wraps the model (default: fsdp2)",
                "--family {" + ",".join(sorted(FAMILIES)) + "}",
                "(default: qwen2)",
                "(default: 3)",
                "(default: a new temporary directory)",
                "equals the trainer's, bit for bit.",  # the description is whole, not cut mid-sentence
                "0 every sync was bit-exact",
                "2 a mistake in the arguments",
            ],
        ),
        (
            check_main,
            [
                "--backend {fsdp2,fsdp1,plain}",
                "how the trainer wraps the model (default: fsdp2)",
                "--dtype {bfloat16,float16,float32}",
                "(default: bfloat16)",
                "(default: 8)",
                "--adapter with --lora: also check what an adapter sync",
                "--max-lora-rank N",
                "every name the engine would reject.",  # the description is whole, not cut at its first line
                "1 the engine would reject it",
                "2 a mistake in the arguments",
            ],
        ),
    ],
    ids=["demo", "check"],
)
def test_help_lists_choices_defaults_and_exit_codes(command, expected: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        command(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert [e for e in expected if e not in out] == []
    assert "(default: None)" not in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lora-r", "4"], "--lora-r is read with --lora only: add --lora NAMES (e.g. --lora q_proj,v_proj)"),
        (["--engine-dtype", "float32"], "--engine-dtype is read with --compare-fsdp2 only: add --compare-fsdp2"),
        (["--accelerate-config", "fsdp1.yaml"], "--accelerate-config is read with --compare-fsdp2 only: add "
                                                "--compare-fsdp2"),
        (["--engine-dtype", "bfloat16"], "--engine-dtype is read with --compare-fsdp2 only"),  # its default, given
        (["--compare-fsdp2", "--accelerate-config", "a.yaml", "--backend", "fsdp1"],
         "--backend is not read with --compare-fsdp2 (it compares the --accelerate-config's FSDP1 wrapping with its "
         "FSDP2 conversion, without LoRA): drop --backend, or --compare-fsdp2"),
        (["--compare-fsdp2", "--accelerate-config", "a.yaml", "--lora", "q_proj"], "--lora is not read with "
                                                                                     "--compare-fsdp2"),
        (["--compare-fsdp2", "--accelerate-config", "a.yaml", "--lora-r", "4"], "--lora-r is not read with "
                                                                                 "--compare-fsdp2"),
        (["--adapter"], "--adapter checks the adapter --lora adds: add --lora NAMES (e.g. --lora q_proj,v_proj)"),
        (["--lora", "q_proj", "--max-lora-rank", "8"], "--max-lora-rank is read with --adapter only: add --adapter"),
        (["--compare-fsdp2", "--accelerate-config", "a.yaml", "--adapter"], "--adapter is not read with "
                                                                             "--compare-fsdp2"),
    ],
    ids=["lora-r", "engine-dtype", "accelerate-config", "engine-dtype-default", "compare-backend", "compare-lora",
         "compare-lora-r", "adapter", "max-lora-rank", "compare-adapter"],
)  # fmt: skip
def test_check_refuses_an_option_it_would_ignore(argv: list[str], says: str, capsys) -> None:
    """Nothing is read or wrapped: the refusal comes first, one line, exit 2, naming the option that is missing (or
    the mode that does not read it)."""
    assert check_main(["/nonexistent/model", *argv]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("fsdp-vllm-sync-check: error: ") and says in captured.err
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--lora", "q_proj", "--lora-r", "4", "--backend", "fsdp1", "--dtype", "float32"],
        ["--lora", "q_proj", "--adapter", "--max-lora-rank", "8", "--dtype", "float32"],
        ["--compare-fsdp2", "--accelerate-config", "a.yaml", "--engine-dtype", "float32", "--dtype", "float32"],
    ],
    ids=["check", "adapter", "compare-fsdp2"],
)
def test_check_takes_the_options_each_mode_reads(argv: list[str]) -> None:
    from fsdp_sync.dry_run import _given, _refuse_ignored, build_parser

    args = build_parser().parse_args(["M", *argv])
    given = _given(["M", *argv], args)
    assert given >= {"dtype", "model_dir"}
    _refuse_ignored(args, given)  # no UsageError
