"""A fork server for test jobs: the ranks of a job are forked from a process that has already imported the stack.

Why: on the 2-core CI machine, a rank of an end-to-end job spent about 10 of its CPU seconds importing torch,
transformers, TRL and vLLM before doing anything, and `accelerate launch` another 3-4 in its own launcher process:
about half of a small job's CPU time, paid again by every one of the suite's ~100 launches (docs/testing.md has the
figures). Here the imports are paid once per test session; each rank is still a process of its own, joined by
real torch.distributed (gloo), with exactly the environment `accelerate launch` gives it: the environment of each
accelerate config is captured once from a real `accelerate launch` of this module (`--dump-env`), then replayed with
the job's port. What differs from `accelerate launch`, on purpose:
- no torchrun agent: rank 0 hosts the rendezvous store (`TORCHELASTIC_USE_AGENT_STORE=False`) and no elastic error
  file is named;
- like torchrun, when one rank exits non-zero the others get SIGTERM, then SIGKILL 30 s later, and the job's exit
  code is 1.
A request whose environment differs from the server's (a test that sets `PYTHONPATH` for a `sitecustomize`, say) is
refused, and `launch_job` falls back to a real `accelerate launch`: variables read at import time must not differ
from what the imported modules saw.

Test-side only (not API): `tests/e2e/conftest.py` starts one server per session; `launch_job` uses it when
`PREFORK_ENV` names its socket.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["PREFORK_ENV", "PreforkRefused", "PreforkServer", "run_on_server"]

PREFORK_ENV = "FSDP_VLLM_SYNC_TEST_PREFORK"
# Set only in the server's own process, never in a job's: pyarrow's bundled jemalloc starts a background thread at
# import (TRL imports `datasets`), and a process that forks must hold no thread but the forking one.
_SERVER_ONLY = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}
# What a job's ranks import first; a module missing on an older stack (a matrix leg) is skipped.
_PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "accelerate",
    "peft",
    "datasets",
    "trl",
    "vllm",
    "vllm.entrypoints.llm",
    "fsdp_sync",
    "fsdp_sync.mixin",
    "tests.support.grpo_job",
    "tests.support.async_job",
)
# Variables that change from test to test, or that a library of the test process sets when first used, after the
# server started: not compared; the ranks get the job's values in their environment (and pass them on to whatever
# they start). Seen in CI: torch's inductor cache directory (its default); OpenCV's import puts its own lib64 on
# LD_LIBRARY_PATH (read by the loader at a process's start: a forked rank searches the server's path, and no job
# loads OpenCV); VLLM_LOGGING_LEVEL=ERROR (read when vLLM's logger is configured: a forked rank logs at the
# server's level, more lines, no other effect).
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "LD_LIBRARY_PATH", "VLLM_LOGGING_LEVEL"})
_MODULE = "tests.support.prefork"  # `__name__` is "__main__" in the server
# torchrun's grace period between SIGTERM and SIGKILL for the ranks left when one failed.
_TERM_GRACE_S = 30.0


class PreforkRefused(RuntimeError):
    """The server cannot run this job as `accelerate launch` would (its reason says why); launch it for real."""


# ---------------------------------------------------------------------------------------------------- client side


def run_on_server(
    socket_path: str,
    *,
    module: str,
    job_args: list[str],
    log_path: Path,
    env: dict[str, str],
    config: dict[str, Any] | None,
    num_processes: int,
    port: int,
    timeout: float,
) -> int:
    """Run a job on the fork server; its exit code (0 when every rank exited 0, else 1, as torchrun's).

    Raises:
        PreforkRefused: the server will not run it (environment differs, or the server is gone).
        subprocess.TimeoutExpired: the job ran past `timeout` seconds (its ranks were killed).
    """
    request = {
        "module": module,
        "args": job_args,
        "log": str(log_path),
        "env": env,
        "cwd": os.getcwd(),
        "config": config,
        "num_processes": num_processes,
        "port": port,
        "timeout": timeout,
    }
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout + 120)  # the server enforces `timeout`; this only guards against a hung server
            conn.connect(socket_path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(_read_line(conn))
    except (OSError, ValueError) as e:
        raise PreforkRefused(f"the fork server at {socket_path} did not answer ({type(e).__name__}: {e})") from e
    if "refused" in reply:
        raise PreforkRefused(reply["refused"])
    if reply.get("timed_out"):
        raise subprocess.TimeoutExpired(f"{module} (forked ranks)", timeout)
    return int(reply["returncode"])


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("connection closed before a whole reply")
        data += chunk
    return data


class PreforkServer:
    """Start the fork server in a process of its own; `socket_path` once it has imported the stack.

    Args:
        directory: where the socket and the server's log live.
        env: the environment jobs are launched with (the server serves only requests carrying exactly this one).
        ready_timeout: seconds to wait for the imports.
    """

    def __init__(self, directory: Path, env: dict[str, str], *, ready_timeout: float = 600) -> None:
        self.socket_path = str(directory / "prefork.sock")
        self.log_path = directory / "prefork.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", _MODULE, "serve", self.socket_path],
                env={**env, **_SERVER_ONLY},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + ready_timeout
        while not Path(self.socket_path).exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the fork server did not start in {ready_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


# ---------------------------------------------------------------------------------------------------- server side


def _serve(socket_path: str) -> None:
    base = {k: v for k, v in os.environ.items() if k not in _SERVER_ONLY}
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optional module of an older stack; the job imports what it needs
            print(f"prefork: not preloaded {name}: {type(e).__name__}: {e}", flush=True)
    _probe_vector_isas()
    # NOTE: what the imports themselves set (vLLM's `env_override` sets PYTORCH_NVML_BASED_CUDA_CHECK and others at
    # import): a job that started with those values, as one launched from a test process that imported vLLM does,
    # is what a forked rank is.
    imported = {k: v for k, v in os.environ.items() if k not in _SERVER_ONLY}
    threads = sorted(os.listdir("/proc/self/task"))
    if threading.active_count() != 1 or len(threads) != 1:
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in threads]
        raise SystemExit(f"prefork: refusing to serve: threads running after the imports ({names}); forking would copy their locks")
    # NOTE: the imports leave about 630k objects the garbage collector tracks; every full collection walks them all
    # (0.3-0.4 s each on the 2-core CI machine), and vLLM alone collects seven times per engine start and stop.
    # Frozen here, before any fork, they are left out of every collection in the ranks (and their pages are not
    # written by the collector, so they stay shared), as CPython's docs for `gc.freeze` advise for a fork server.
    gc.collect()
    gc.freeze()
    captured: dict[str, list[dict[str, str]]] = {}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path + ".tmp")
    server.listen(4)
    os.rename(socket_path + ".tmp", socket_path)  # the client waits for this path: ready only once listening
    print(f"prefork: serving on {socket_path} ({len(sys.modules)} modules imported)", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                reply = _handle(json.loads(_read_line(conn)), base, imported, captured, server)
            except Exception as e:  # noqa: BLE001 - answered to the client, which falls back to a real launch
                reply = {"refused": f"the fork server failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"}
            conn.sendall(json.dumps(reply).encode() + b"\n")


def _probe_vector_isas() -> None:
    """Inductor's probe of the CPU's vector instruction sets, once, for every rank to inherit.

    Why: each process that compiles anything with Inductor (a colocated engine's sampler computes logprobs through a
    compiled function) first builds and loads a test library per instruction set, in helper processes: measured,
    1.2 CPU s per rank. The result is cached in the process (`functools.cache`), so a forked rank starts with it.
    """
    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    except ImportError:  # a torch without Inductor's CPU backend: nothing to probe
        return
    valid_vec_isa_list()


def _handle(
    request: dict[str, Any],
    base: dict[str, str],
    imported: dict[str, str],
    captured: dict[str, list[dict[str, str]]],
    server: socket.socket,
) -> dict[str, Any]:
    env = request["env"]
    differs = sorted(
        k for k in (set(env) | set(base)) - _VOLATILE if env.get(k) != base.get(k) and env.get(k) != imported.get(k)
    )
    if differs:
        return {"refused": f"the job's environment differs from the fork server's in {differs}"}
    config, n = request["config"], request["num_processes"]
    if config is None:
        rank_envs = [dict(env)]
    else:
        key = json.dumps([config, n], sort_keys=True)
        if key not in captured:
            captured[key] = _capture(config, n, env)
        rank_envs = []
        for added in captured[key]:
            rank_env = {**env, **added, "MASTER_PORT": str(request["port"]), "TORCHELASTIC_USE_AGENT_STORE": "False"}
            rank_env.pop("TORCHELASTIC_ERROR_FILE", None)
            rank_envs.append(rank_env)
    return _run_ranks(request, rank_envs, server)


def _capture(config: dict[str, Any], num_processes: int, env: dict[str, str]) -> list[dict[str, str]]:
    """What a real `accelerate launch` of `config` adds to each rank's environment (rank order)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp, "accelerate.json")
        cfg.write_text(json.dumps(config))
        from .dist import free_port

        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "--main_process_port",
               str(free_port()), "-m", _MODULE, "dump-env", tmp]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"capturing accelerate's environment failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        ranks = [json.loads(Path(tmp, f"env{r}.json").read_text()) for r in range(num_processes)]
    return [{k: v for k, v in rank.items() if env.get(k) != v} for rank in ranks]


def _run_ranks(request: dict[str, Any], rank_envs: list[dict[str, str]], server: socket.socket) -> dict[str, Any]:
    import resource

    sys.stdout.flush()
    sys.stderr.flush()
    started = resource.getrusage(resource.RUSAGE_CHILDREN)
    pids = []
    for rank_env in rank_envs:
        pid = os.fork()
        if pid == 0:
            server.close()
            _rank(request, rank_env)  # never returns
        with contextlib.suppress(OSError):  # also set in the child; whichever runs first wins the race
            os.setpgid(pid, pid)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    term_deadline: float | None = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        now = time.monotonic()
        if now > deadline:
            _signal(pids, codes, signal.SIGKILL)
            for pid in pids:
                if pid not in codes:
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            return {"timed_out": True}
        failed = any(code != 0 for code in codes.values())
        if failed and term_deadline is None and len(codes) < len(pids):
            _signal(pids, codes, signal.SIGTERM)  # as torchrun does when a worker fails
            term_deadline = now + _TERM_GRACE_S
        if term_deadline is not None and now > term_deadline:
            _signal(pids, codes, signal.SIGKILL)
            term_deadline = float("inf")
        time.sleep(0.05)
    exit_codes = [codes[pid] for pid in pids]
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ended.ru_utime + ended.ru_stime - started.ru_utime - started.ru_stime
    with open(request["log"], "a") as log:
        log.write(f"[prefork] ranks exited with {exit_codes} ({cpu:.1f} CPU seconds)\n")
    return {"returncode": 0 if all(c == 0 for c in exit_codes) else 1, "ranks": exit_codes}


def _signal(pids: list[int], codes: dict[int, int], sig: int) -> None:
    for pid in pids:
        if pid not in codes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)


def _rank(request: dict[str, Any], env: dict[str, str]) -> None:
    """In the forked child: become the rank `python -u -m module args` would have started, run it, exit."""
    code = 1
    try:
        os.setpgid(0, 0)  # the rank and whatever it starts are signalled together
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sys.argv = [request["module"], *request["args"]]
        import runpy

        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
    except BaseException:  # noqa: BLE001 - printed into the job's log, as an uncaught error of `python -m` would be
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _dump_env(directory: str, *, fail_rank: int | None = None, sleep_s: float = 0.0) -> None:
    """The probe `_capture` launches with `accelerate launch`: writes this rank's environment (and pid). For the
    launcher's own tests, `fail_rank` exits 3 on that rank and `sleep_s` keeps the other ranks alive that long."""
    rank = int(os.environ.get("RANK", "0"))
    Path(directory, f"env{rank}.json").write_text(json.dumps(dict(os.environ)))
    Path(directory, f"pid{rank}").write_text(str(os.getpid()))
    if rank == fail_rank:
        sys.exit(3)
    time.sleep(sleep_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve").add_argument("socket")
    dump = sub.add_parser("dump-env")
    dump.add_argument("directory")
    dump.add_argument("--fail-rank", type=int)
    dump.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        _serve(args.socket)
    else:
        _dump_env(args.directory, fail_rank=args.fail_rank, sleep_s=args.sleep)


if __name__ == "__main__":
    main()
