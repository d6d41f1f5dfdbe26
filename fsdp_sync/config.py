"""User-facing options of the sync, validated once."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncConfig"]

_FSDP1 = ("unit", "root", "flat")
_FSDP2 = ("unit", "param", "flat")


@dataclass(frozen=True)
class SyncConfig:
    """How weights are gathered and pushed.

    Attributes:
        fsdp1_strategy: `"flat"` (default; fastest measured on CPU and GPU, see docs/benchmarks.md): one all-gather
            per FSDP unit of its flat shard cast to the engine dtype, the next unit's gather overlapping the current
            push. `"unit"`: `summon_full_params(unit, recurse=False)` one unit at a time, parents first; peak memory
            one unit. `"root"`: one `summon_full_params(root, recurse=True)`; peak memory the whole model, on every
            rank.
        fsdp2_strategy: `"flat"` (default), as FSDP1's from the units' local shards; `"unit"`: `unshard()` one unit
            at a time; `"param"`: one `full_tensor()` per parameter. Every strategy merges PEFT adapters (the merge
            reads the adapter weights the gather delivers); the flat ones gather what the merge reads uncast.
        prefetch_bytes: the bucket of the flat strategy: the next unit is gathered during the current push when its
            gathered size is at most this, so peak memory stays within the largest unit plus this (0: no overlap).
        check_manifest: check names, shapes and dtypes against the engine's checkpoint before the first push.
        checkpoint_dir: the checkpoint the engine was started from, when it is not the engine's model path.
        log_metrics: add the sync figures to the trainer's logged metrics.
        server_timeout_s: server mode: the bound on each wait the transfer adds (the rendezvous with the server,
            each HTTP answer, each broadcast of a chunk); past it the sync fails on every rank instead of hanging.
        server_buffer_bytes: server mode: the size of one chunk on the wire (and of the send/receive buffers, two
            on the trainer's sender, one on each server worker).
        sync_timeout_s: the bound on every wait the sync adds between ranks: the agreement on each sync's outcome
            (how long a rank that finished waits for the others) and, on gloo, each all-gather the sync runs itself.
            Past it every rank that is still alive raises `SyncTimeoutError` naming the ranks that did not arrive.
            Keep it above the longest push of one rank (server mode: above `server_timeout_s`).
        check_finite: before each sync, look for NaN/Inf in every rank's own shards (no gather; one pass over the
            local weights); any found: every rank raises `NonFiniteWeightsError` naming them, nothing is sent.
        delta: after one complete sync, send only the tensors that can have changed (trainable parameters; for PEFT
            the base weights adapters merge into, and `modules_to_save` copies), each widened to whole engine
            modules, and skip the rest (frozen weights, base weights without adapters); the first sync, every sync
            after a failed one and every sync after the trainable set changed are complete. See `fsdp_sync.sync.delta`.
        delta_check: with `delta`, prove every sync that the skipped weights did not change: each rank fingerprints
            its own shards of them (no gather) against their fingerprints when last pushed, the ranks agree, and a
            changed one is sent and logged. Off only if nothing but the optimizer ever writes the weights.
        verify: after each push, compare the engine's own per-parameter sha256 digests with digests of what was
            sent (computed trainer-side in the engine's fused layout); a difference raises `VerifyError` on every
            rank; weights the engine cannot show are reported as unverifiable. Costs a hash of every byte on both
            sides (docs/failures.md has the figures). With `sparse`, the weights sent as patches are gathered whole
            for their digests (a proof, not a production setting).
        sparse: with `delta`, send the engine-dtype elements that changed since the last push instead of whole
            tensors (docs/sparse.md): each rank keeps its shards as last pushed, in the engine dtype (model size x
            engine itemsize / world size per rank), diffs them, and the ranks gather (index, value) patches, which the
            engine applies in place (vLLM >= 0.32's `load_checkpoint_weight_patches`; on a CPU server, started with
            `FSDP_VLLM_SYNC_SPARSE=1`). Tensors the engine cannot patch in place (converted layouts such as fused
            experts, quantized layers, PEFT merges) and tensors over `sparse_max_density` go whole, with their engine
            module. Colocated engines on the CPU keep their linear weights unpacked beside the GEMM pack for it
            (twice the linear weights' engine memory).
        sparse_max_density: the changed fraction of an engine module (`qkv_proj`, `o_proj`, ...: what vLLM's
            reload processes as one) above which it is sent whole. The default lies between the densities measured
            where patches won (about 2% changed: 1.5-2x faster syncs) and where they lost (13-25%); not swept finer
            (docs/sparse.md).
        group_port: server mode: the TCP port the trainer's sender hosts the weight-transfer group on (overrides
            the trainer's `vllm_group_port`; TRL's async trainer has none); None: the trainer's `vllm_group_port`,
            else 51216.
        adapter: for a PEFT LoRA model, push only the adapter (`lora_A`, `lora_B`) into the engine's LoRA manager, in
            memory, instead of merging it into the base and pushing merged weights (docs/adapters.md). None (the
            default): on where the engine was started with LoRA enabled and can serve the adapter, else merged syncs
            with the reason logged. True: required; what the engine cannot serve (DoRA, `modules_to_save`, a rank
            above its `max_lora_rank`, target modules vLLM does not support for the architecture, a base that
            differs from the engine's checkpoint) is an error before anything is written; a colocated engine that
            TRL builds is started with LoRA enabled for it. False: merged syncs. Delta and sparse options do not
            apply to adapter syncs (the whole adapter goes every time: it is small; `sparse` is refused with
            adapter=True); `check_finite` checks the adapter's pieces; `verify` compares the engine's adapter, as
            its LoRA manager keeps it to serve (every worker of a server), with what was sent, by digest.
    """

    fsdp1_strategy: str = "flat"
    fsdp2_strategy: str = "flat"
    prefetch_bytes: int = 2**30
    check_manifest: bool = True
    checkpoint_dir: str | None = None
    log_metrics: bool = True
    server_timeout_s: float = 300.0
    server_buffer_bytes: int = 64 * 2**20
    sync_timeout_s: float = 600.0
    check_finite: bool = False
    verify: bool = False
    delta: bool = True
    delta_check: bool = True
    sparse: bool = False
    sparse_max_density: float = 0.1
    group_port: int | None = None
    adapter: bool | None = None

    def __post_init__(self) -> None:
        if self.fsdp1_strategy not in _FSDP1:
            raise ValueError(f"fsdp1_strategy={self.fsdp1_strategy!r}; valid: {list(_FSDP1)}")
        if self.prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes={self.prefetch_bytes}; must be >= 0 (0 disables the overlap)")
        if self.server_timeout_s <= 0:
            raise ValueError(f"server_timeout_s={self.server_timeout_s}; must be > 0")
        if self.sync_timeout_s <= 0:
            raise ValueError(f"sync_timeout_s={self.sync_timeout_s}; must be > 0")
        if self.server_buffer_bytes <= 0:
            raise ValueError(f"server_buffer_bytes={self.server_buffer_bytes}; must be > 0")
        if not 0.0 <= self.sparse_max_density <= 1.0:
            raise ValueError(f"sparse_max_density={self.sparse_max_density}; must be within [0, 1]")
        if self.sparse and not self.delta:
            raise ValueError("sparse=True builds on delta syncs; set delta=True (the default) or sparse=False")
        if self.group_port is not None and not 0 < self.group_port < 65536:
            raise ValueError(f"group_port={self.group_port}; must be a TCP port (1-65535) or None")
        if self.adapter and self.sparse:
            raise ValueError("adapter=True pushes the whole adapter each sync; sparse=True applies to merged syncs only")
        if self.fsdp2_strategy not in _FSDP2:
            raise ValueError(f"fsdp2_strategy={self.fsdp2_strategy!r}; valid: {list(_FSDP2)}")
