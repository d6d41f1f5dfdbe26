"""Where a vLLM model's own loader puts each checkpoint tensor, found by running `load_weights` dry.

Why: what a checkpoint tensor becomes inside the engine is decided by model-specific loader code (renaming, fusing,
slicing for tensor parallelism, transposing, per-expert stacking). Three questions of this package depend on it:

- **Can an in-place reload update it?** vLLM's layer-wise reload moves each layer to the meta device and buffers
  what reaches the parameters' weight loaders; a loader that copies into a parameter directly, bypassing its weight
  loader, writes into nothing, and the layer gets its old tensor back with no error (gpt-oss's sinks and expert
  stacks on vLLM 0.32, before `vllm_patches.load_gpt_oss_through_weight_loaders`). Such a tensor is refused before
  any write (`reload_gaps`).
- **Is its engine digest predictable?** Only where it lands as one whole, uncast (or exactly widened) copy into a
  contiguous run of a parameter (`verify` compares digests; transposed Conv1D weights, tensor-parallel slices and
  converted layouts cannot be).
- **Where does a sparse patch of it go?** The same single copy gives the flat offset in the parameter
  (`patch_api.find_patch_targets`).

How: one `load_weights` call over every tensor (meta tensors, or uninitialised ones where a patch target needs the
source's address), with every parameter's weight loader wrapped by a recorder that calls it, and every write into a
tensor (`Tensor.copy_`, item assignment, `.data =`) caught and skipped by a torch function mode. Function modes are
thread-local, so a copy made by another thread meanwhile (a data loader, an engine thread) runs untouched; only the
weight loaders are swapped process-wide, for the duration of the call, and restored after. Nothing is written into
the engine. Each caught event is charged to the tensor the loader last took from the iterator (vLLM's loaders
stream); a loader that cannot run dry on the batch is run per tensor, and one that cannot run on a tensor gives that
tensor an `error` instead of a landing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Copy", "Landing", "probe_loads", "reload_gaps"]

# Exact float widenings: an engine may keep a 16-bit weight in float32 (vLLM-CPU widens small linear layers'
# biases); the values, and so the digest of the widened bytes, stay determined by what was sent.
_WIDENINGS = frozenset({(torch.bfloat16, torch.float32), (torch.float16, torch.float32)})


@dataclass(frozen=True)
class Copy:
    """One write into an engine parameter while a tensor loaded.

    Attributes:
        param: the engine parameter written.
        offset: where the written run starts in the parameter's flattened elements (-1: not a contiguous run).
        numel: elements written.
        whole: the source is the checkpoint tensor itself, unsliced and untransposed.
        dtype: the parameter's dtype; the source's is the checkpoint tensor's.
        in_loader: written by the parameter's weight loader (else by the model's loader code directly).
    """

    param: str
    offset: int
    numel: int
    whole: bool
    dtype: torch.dtype
    in_loader: bool


@dataclass
class Landing:
    """Where one checkpoint tensor went: the parameters whose weight loader took it, and every write."""

    loaders: list[str] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    error: str | None = None

    @property
    def direct(self) -> list[str]:
        """Parameters written outside any weight loader (what a layer-wise reload drops)."""
        return sorted({c.param for c in self.copies if not c.in_loader})

    def single_copy(self, dtype: torch.dtype) -> Copy | None:
        """The landing's write when it is one whole copy of a `dtype` tensor into a contiguous run of a parameter,
        uncast or exactly widened (the parameter then holds exactly the sent values)."""
        if len(self.copies) != 1 or self.error is not None:
            return None
        copy = self.copies[0]
        exact = copy.dtype == dtype or (dtype, copy.dtype) in _WIDENINGS
        return copy if copy.whole and copy.offset >= 0 and exact else None

    def predictable(self, dtype: torch.dtype) -> bool:
        """Whether the engine holds exactly the sent values here (`single_copy`)."""
        return self.single_copy(dtype) is not None


class _Catch(TorchFunctionMode):
    """Skips every write into a tensor and reports it to `probe`."""

    def __init__(self, probe: _Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.copy_:
            self.probe.wrote(args[0], args[1])
            return args[0]
        if func is torch.Tensor.__setitem__:
            self.probe.wrote(args[0], None)
            return None
        if func is torch.Tensor.data.__set__:  # type: ignore[attr-defined]
            self.probe.wrote(args[0], None)
            return None
        return func(*args, **(kwargs or {}))


class _Probe:
    """The state of one dry run: the engine's parameters by storage, and the landing being recorded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, param in self.params.items():
            if param.numel() and not param.is_meta:
                self.by_storage.setdefault(param.untyped_storage().data_ptr(), []).append((name, param))
        self.current: Landing | None = None
        self.source: torch.Tensor | None = None
        self.depth = 0
        # Each checkpoint tensor handed to the loader, by identity: what a write or a loader call receives is charged
        # to the tensor it is (a view of), since vLLM's loaders read the iterator ahead (`AutoWeightsLoader` groups
        # tensors by module prefix with `itertools.groupby`, which takes the next tensor before the last of a group
        # is loaded), so "the tensor last handed out" is not always the one being loaded.
        self.sources: dict[int, tuple[Landing, torch.Tensor]] = {}

    def owner(self, tensor: Any) -> tuple[Landing, torch.Tensor] | None:
        """The checkpoint tensor `tensor` is, or is a view of; None for a tensor the loader computed anew."""
        while isinstance(tensor, torch.Tensor):
            found = self.sources.get(id(tensor))
            if found is not None:
                return found
            tensor = tensor._base
        return None

    def wrote(self, destination: torch.Tensor, source: torch.Tensor | None) -> None:
        found = self.owner(source)
        landing, whole_source = found if found is not None else (self.current, self.source)
        if landing is None or destination.is_meta or not destination.numel():
            return
        owners = self.by_storage.get(destination.untyped_storage().data_ptr(), [])
        for name, param in owners:
            offset = destination.storage_offset() - param.storage_offset()
            contiguous = destination.is_contiguous() and param.is_contiguous()
            inside = 0 <= offset and offset + destination.numel() <= param.numel()
            whole = (
                source is not None
                and whole_source is not None
                and source.shape == whole_source.shape
                and source.stride() == whole_source.stride()
                and (source.is_meta or source.data_ptr() == whole_source.data_ptr())
            )
            landing.copies.append(
                Copy(name, offset if contiguous and inside else -1, destination.numel(), whole, param.dtype,
                     self.depth > 0)
            )  # fmt: skip
            return

    def recorder(self, name: str, loader: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            found = next(filter(None, map(self.owner, [*args[1:], *kwargs.values()])), None)
            outer = self.current, self.source
            if found is not None:  # the writes inside this loader are this tensor's
                self.current, self.source = found
            if self.current is not None and name not in self.current.loaders:
                self.current.loaders.append(name)
            self.depth += 1
            try:
                return loader(*args, **kwargs)
            finally:
                self.depth -= 1
                self.current, self.source = outer

        return record


_MISSING = object()


def probe_loads(
    model: torch.nn.Module, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *, real_sources: bool = False
) -> dict[str, Landing]:
    """Run `model.load_weights` dry over every named checkpoint tensor and return where each one landed.

    Args:
        model: the engine's model (vLLM), with its weights loaded.
        specs: checkpoint name -> (shape, dtype) of each tensor to probe.
        real_sources: pass uninitialised host tensors instead of meta ones (a `Copy.whole` then also means the very
            same storage; costs their allocation, which the OS maps lazily).
    """
    from .vllm_patches import unwrap_reload_loaders

    unwrap_reload_loaders(model)
    probe = _Probe(model)
    originals: dict[int, tuple[torch.Tensor, Any]] = {}
    for name, param in probe.params.items():
        if id(param) in originals:
            continue
        try:
            loader = param.weight_loader  # type: ignore[attr-defined]
        except AttributeError:
            loader = _MISSING
        originals[id(param)] = (param, loader)
        param.weight_loader = probe.recorder(name, loader if loader is not _MISSING else _default_loader())  # type: ignore[attr-defined]
    landings = {name: Landing() for name in specs}
    device = "cpu" if real_sources else "meta"

    def stream(names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            shape, dtype = specs[name]
            probe.current, probe.source = landings[name], torch.empty(shape, dtype=dtype, device=device)
            probe.sources[id(probe.source)] = (probe.current, probe.source)
            yield name, probe.source

    try:
        with torch.no_grad(), _Catch(probe):
            try:
                model.load_weights(stream(list(specs)))
            except Exception:  # noqa: BLE001 - a loader that cannot take the batch dry: one tensor at a time
                for name in specs:
                    landings[name] = Landing()
                    try:
                        model.load_weights(stream([name]))
                    except Exception as e:  # noqa: BLE001 - recorded: this tensor's landing is unknown
                        landings[name] = Landing(error=f"{type(e).__name__}: {e}")
    finally:
        probe.current = probe.source = None
        probe.sources.clear()
        for param, loader in originals.values():
            if loader is _MISSING:
                del param.weight_loader  # type: ignore[attr-defined]
            else:
                param.weight_loader = loader  # type: ignore[attr-defined]
    return landings


def _default_loader() -> Any:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return default_weight_loader


def reload_gaps(landings: Mapping[str, Landing]) -> dict[str, str]:
    """Checkpoint name -> why an in-place, layer-wise reload would not update it, for every such tensor: the model's
    loader writes it into a parameter directly, outside the parameter's weight loader (see the module docstring)."""
    gaps: dict[str, str] = {}
    for name, landing in landings.items():
        if landing.direct and not landing.loaders:
            gaps[name] = (
                f"vLLM's loader for this model copies it into {', '.join(landing.direct)} directly, bypassing the "
                "weight loader that vLLM's in-place reload relies on, so a reload keeps the old values"
            )
    return gaps
