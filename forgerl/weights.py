"""Weight formats between the trainer and the rollout engines: deltas, packed buffers, groups.

Data flow: the trainer side (`forgerl.trainer.weight_sync.WeightSync`) makes what is sent; the
engines (`forgerl.engines.*`), the router and the Ray cluster take it apart. Both halves import
this module, which imports only torch.

- Delta: per tensor, the flat indices (int32) and new values of the changed elements, or the
  whole tensor when that is fewer bytes, plus zlib.crc32 of the tensor's engine-dtype bytes
  before (base) and after (result) (`make_delta`). A tensor that did not change is an empty
  entry, so the engine checks the base of every tensor. An engine takes deltas when it
  implements `DeltaEngine` (optional, beside `RolloutEngine`): `weight_dtype` and
  `apply_delta(delta, version)`, which applies between decode steps through `apply_delta`
  below, all or nothing: a delta computed against another version, or whose base or result
  checksum does not match, raises `DeltaMismatch` and leaves the old weights and version.
- Tied tensors (one storage under two names, e.g. SmolLM2's embedding and lm_head) are sent
  once (`unique_tensors`).
- Packed: all tensors in one flat uint8 buffer (`pack` / `unpack`), for a transport that moves
  one buffer: a torch.distributed broadcast over a process group of its own (`weight_group`).
"""

from __future__ import annotations

import datetime
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaMismatch(ValueError):
    """A delta does not fit the engine's weights (version, names, dtype or checksum)."""


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's change in the engine's dtype.

    indices: (K,) int32 flat positions of the changed elements (int64 above 2**31 elements), or
    None for a dense entry. values: (K,) the new values there, or (numel,) every new value when
    dense; dtype = the engine's. base_crc / result_crc: `checksum` of the tensor before / after.
    """

    indices: Tensor | None
    values: Tensor
    base_crc: int
    result_crc: int

    @property
    def nbytes(self) -> int:
        """Payload bytes (indices + values)."""
        idx = 0 if self.indices is None else self.indices.numel() * self.indices.element_size()
        return idx + self.values.numel() * self.values.element_size()


@dataclass(frozen=True)
class WeightDelta:
    """The change from the weights of `base_version` to the next version: name → TensorDelta
    for every synced tensor. changed: elements whose bits changed; numel: all elements."""

    base_version: int
    tensors: dict[str, TensorDelta]
    changed: int
    numel: int

    @property
    def nbytes(self) -> int:
        """Payload bytes over all tensors."""
        return sum(d.nbytes for d in self.tensors.values())


@runtime_checkable
class DeltaEngine(Protocol):
    """The optional engine half of delta sync.

    weight_dtype: the dtype of the engine's weights (deltas are computed in it).
    """

    weight_dtype: torch.dtype

    async def apply_delta(self, delta: WeightDelta, version: int) -> None:
        """Apply `delta` between decode steps and publish `version`, all or nothing; raises
        DeltaMismatch (old weights and version stay) unless the engine holds exactly the weights
        of `delta.base_version`."""
        ...


def checksum(t: Tensor) -> int:
    """zlib.crc32 of the tensor's bytes (a CPU copy first if it lives elsewhere); position and
    bit exact."""
    return zlib.crc32(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())


def _bits(t: Tensor) -> Tensor:
    """The flat tensor viewed as integers of the same width (exact bitwise comparison)."""
    return t.reshape(-1).view(_INT[t.element_size()])


def unique_tensors(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`state_dict` without the later names of tensors that share one storage (tied weights)."""
    seen, out = set(), {}
    for name, t in state_dict.items():
        key = (t.device, t.data_ptr(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def make_delta(
    base: Mapping[str, Tensor],
    base_crcs: Mapping[str, int],
    new: Mapping[str, Tensor],
    base_version: int,
) -> tuple[WeightDelta, dict[str, int]]:
    """The delta from `base` (version `base_version`, checksums `base_crcs`) to `new`; both map
    the same names to tensors of one shape and dtype (KeyError: a name of `new` missing from
    `base` or `base_crcs`). Returns (delta, checksums of `new`: name → `checksum`)."""
    tensors, crcs, changed, numel = {}, {}, 0, 0
    for name, n in new.items():
        flat = n.reshape(-1)
        mask = _bits(base[name]) != _bits(n)  # (numel,) bool
        k, crcs[name] = int(mask.count_nonzero()), checksum(n)
        itemsize, index_dtype = n.element_size(), torch.int32 if n.numel() < 2**31 else torch.int64
        if k * (itemsize + index_dtype.itemsize) >= flat.numel() * itemsize:
            tensors[name] = TensorDelta(None, flat, base_crcs[name], crcs[name])
        else:
            idx = mask.nonzero().squeeze(1)  # (k,) int64
            tensors[name] = TensorDelta(idx.to(index_dtype), flat[idx], base_crcs[name], crcs[name])
        changed, numel = changed + k, numel + flat.numel()
    return WeightDelta(base_version, tensors, changed, numel), crcs


def apply_delta(params: Mapping[str, Tensor], delta: WeightDelta, version: int) -> None:
    """Apply `delta` in place to `params` (name → contiguous tensor), which hold `version`.

    All or nothing: raises DeltaMismatch before any write when version != delta.base_version,
    a name is unknown, a dtype differs or a base checksum differs; after the writes, a result
    checksum that differs (a corrupted delta) or any other error restores the old values and
    re-raises.
    """
    if version != delta.base_version:
        raise DeltaMismatch(f"delta base_version ({delta.base_version}) != engine weight_version "
                            f"({version})")
    for name, d in delta.tensors.items():
        p = params.get(name)
        if p is None or p.dtype != d.values.dtype:
            raise DeltaMismatch(f"{name}: not an engine tensor of dtype {d.values.dtype}")
        if checksum(p) != d.base_crc:
            raise DeltaMismatch(f"{name}: engine weights differ from the delta's base")
    undo: list[tuple[Tensor, Tensor | None, Tensor]] = []  # (flat param, indices, old values)
    try:
        with torch.no_grad():
            for name, d in delta.tensors.items():
                flat = params[name].view(-1)
                idx = None if d.indices is None else d.indices.to(flat.device, torch.long)
                undo.append((flat, idx, flat.clone() if idx is None else flat[idx]))
                if idx is None:
                    flat.copy_(d.values)
                else:
                    flat[idx] = d.values.to(flat.device)
            for name, d in delta.tensors.items():
                if checksum(params[name]) != d.result_crc:
                    raise DeltaMismatch(f"{name}: result checksum differs (corrupted delta)")
    except BaseException:
        with torch.no_grad():
            for flat, idx, old in reversed(undo):
                flat.copy_(old) if idx is None else flat.index_copy_(0, idx, old)
        raise


Spec = tuple[str, str, tuple[int, ...]]  # (name, dtype name, shape)
_ALIGN = 64  # bytes: every tensor starts at a multiple (any dtype can view it)


def _offsets(specs: list[Spec]) -> tuple[list[int], int]:
    """Byte offset of each spec's tensor in a packed buffer, and the buffer's size in bytes."""
    offsets, total = [], 0
    for _, dtype, shape in specs:
        offsets.append(total)
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        total += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, total


def packed_nbytes(specs: list[Spec]) -> int:
    """Bytes of the buffer `pack` makes for `specs` (what a receiver allocates)."""
    return _offsets(specs)[1]


def pack(tensors: Mapping[str, Tensor], dtype: torch.dtype | None = None,
         device: torch.device | str | None = None) -> tuple[Tensor, list[Spec]]:
    """All of `tensors` (floating ones cast to `dtype` when given) in one flat uint8 buffer of
    shape (bytes,) on `device` (default: the first tensor's), each starting at a multiple of 64
    bytes, and the specs that `unpack` needs: for a transport that moves one buffer (a
    collective broadcast)."""
    specs = [(k, str(dtype if dtype and t.is_floating_point() else t.dtype)
              .removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()]
    total = packed_nbytes(specs)
    first = next(iter(tensors.values()), torch.empty(0))
    buffer = torch.empty(total, dtype=torch.uint8, device=device or first.device)
    for t, view in zip(tensors.values(), unpack(buffer, specs).values(), strict=True):
        view.copy_(t)
    return buffer, specs


def unpack(buffer: Tensor, specs: list[Spec]) -> dict[str, Tensor]:
    """name → tensor viewing `buffer` (no copy), bitwise what `pack` put there. Raises
    ValueError when the buffer's size does not match the specs."""
    offsets, total = _offsets(specs)
    if buffer.numel() != total:
        raise ValueError(f"packed buffer has {buffer.numel()} bytes, its specs need {total}")
    out = {}
    for off, (name, dtype, shape) in zip(offsets, specs, strict=True):
        dt = getattr(torch, dtype)
        out[name] = buffer[off:off + math.prod(shape) * dt.itemsize].view(dt).view(shape)
    return out


def weight_group(store: dist.Store, rank: int, world: int, epoch: int, backend: str,
                 timeout_s: float) -> dist.ProcessGroup:
    """Rank `rank` of `world` in a process group for weight broadcasts (rank 0 = the trainer),
    apart from the default (data-parallel) group. `store`: a TCPStore hosted by rank 0;
    `epoch` namespaces a group formed again after a member was lost. backend: "nccl" (CUDA) or
    "gloo". Blocks until every rank joined; collectives wait at most `timeout_s` seconds."""
    store = dist.PrefixStore(f"weights{epoch}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, timeout)
