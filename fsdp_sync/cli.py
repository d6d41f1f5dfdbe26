"""What the console scripts share: help that shows every default, one-line errors, and the exit codes.

Why: a plain mistake (a path that does not exist, a LoRA target the model lacks, a missing optional dependency)
must end in one line that says what to do, with exit code 2 (argparse's own code for a usage error), never in a
traceback; exit code 1 stays reserved for "the command ran and found a problem" (the engine would reject the sync,
the demo's job failed).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "HelpFormatter",
    "UsageError",
    "first_line",
    "joined_lines",
    "make_parser",
    "meta_model",
    "positive_int",
    "require",
    "run",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A plain mistake in a command's input or environment; the message is the whole report, so it names the fix."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's line breaks and appends "(default: ...)" to every option that has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # NOTE: this is the hook ArgumentDefaultsHelpFormatter itself overrides; an option whose default is None
        # ("not given") gets no "(default: None)".
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def make_parser(prog: str, description: str, *, epilog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser with this package's help layout; commands add their own options to it."""
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter)


def positive_int(value: str) -> int:
    """An argparse `type` for counts: a malformed or non-positive value is a usage error, not a traceback."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


def require(modules: Mapping[str, str], *, hint: str = "") -> None:
    """Check that optional dependencies are importable before a command starts its work.

    Args:
        modules: top-level import name -> the extra of this distribution that installs it.
        hint: appended to the message (e.g. where a pinned build comes from).

    Raises:
        UsageError: naming every missing module and the `pip install` line with the extras that bring them.
    """
    # NOTE: find_spec locates a top-level module without importing it, so the check costs nothing when all is there.
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        extras = ",".join(sorted({modules[name] for name in missing}))
        raise UsageError(
            f"{', '.join(missing)} not installed; install with: pip install 'fsdp-vllm-sync[{extras}]'"
            + (f" {hint}" if hint else "")
        )


def run(command: str, body: Callable[[], int]) -> int:
    """Run a command's body and return its exit code; a `UsageError` becomes one line on stderr and `EXIT_USAGE`."""
    try:
        return body()
    except UsageError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def first_line(error: Exception) -> str:
    """The first line of a library's error message (transformers' and PEFT's can span many)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def joined_lines(error: Exception) -> str:
    """A multi-line error message on one line (a YAML parser's says where on its second and third lines)."""
    return " ".join(line.strip() for line in str(error).strip().splitlines() if line.strip()) or type(error).__name__


def meta_model(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of a checkpoint directory, built from its config on the meta device (both check tools)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # The structure comes from the config alone, on the meta device: no weight is read, and a checkpoint that does
    # not match the model is reported by the check instead of failing the load.
    try:
        config = AutoConfig.from_pretrained(str(directory))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    # NOTE: any exception: the config is the user's input, and transformers raises what a field's own code raises
    # (TypeError, KeyError, AttributeError) for a value of the wrong type; each is a plain mistake, never a traceback.
    except Exception as e:  # noqa: BLE001 - unreadable config, unknown model type, not a causal LM
        raise UsageError(f"cannot build a causal LM from {directory / 'config.json'}: {first_line(e)}") from e
