"""Meshes over a gang and how arrays are split over them: pure math shared by client,
controller and workers, so that all three agree on which host holds which piece.

A gang's devices are numbered slice-major: device `g` is chip `g % chips_per_host` of
host `(g // chips_per_host) % hosts_per_slice` of slice `g // chips_per_slice`, and the
jax.distributed process id of a host is `g // chips_per_host`. Each mesh axis has a DCN
part (across slices) and an ICI part (inside a slice), laid out like
`jax.experimental.mesh_utils.create_hybrid_device_mesh`: DCN-major within every axis.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from slicewise.common.errors import InvalidRequestError, ProgramMismatchError
from slicewise.common.limits import MAX_MESH_AXES

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh

Index = tuple[slice, ...]


@dataclass(frozen=True)
class MeshAxis:
    """One named mesh axis of size `dcn * ici`."""

    name: str
    dcn: int = 1
    ici: int = 1

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise InvalidRequestError(f"mesh axis name {self.name!r} is not an identifier")
        if self.dcn < 1 or self.ici < 1:
            raise InvalidRequestError(
                f"mesh axis {self.name!r} has dcn={self.dcn}, ici={self.ici}; both must be >= 1"
            )

    @property
    def size(self) -> int:
        return self.dcn * self.ici


@dataclass(frozen=True)
class GangShape:
    """How many slices a gang has and how its chips are spread over hosts."""

    num_slices: int
    hosts_per_slice: int
    chips_per_host: int

    @property
    def chips_per_slice(self) -> int:
        return self.hosts_per_slice * self.chips_per_host

    @property
    def num_devices(self) -> int:
        return self.num_slices * self.chips_per_slice

    @property
    def num_processes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    def process_of(self, device: int) -> int:
        """The jax.distributed process id that owns global device `device`."""
        return device // self.chips_per_host


@dataclass(frozen=True)
class MeshSpec:
    """A named mesh over a gang: the axes, in order, with their DCN and ICI parts."""

    axes: tuple[MeshAxis, ...]

    def __post_init__(self) -> None:
        if not self.axes:
            raise InvalidRequestError("a mesh needs at least one axis")
        if len(self.axes) > MAX_MESH_AXES:
            raise InvalidRequestError(
                f"the mesh has {len(self.axes)} axes, more than the {MAX_MESH_AXES} a mesh may "
                "have; merge or drop axes (an axis of size 1 can usually go)"
            )
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"mesh axis names repeat: {names}")

    @classmethod
    def build(
        cls, dcn: Mapping[str, int] | None = None, ici: Mapping[str, int] | None = None
    ) -> MeshSpec:
        """Builds a mesh from DCN axis sizes and ICI axis sizes; a name in both is hybrid.

        Axes come in the order DCN names first, then ICI names not already seen.
        """
        dcn, ici = dict(dcn or {}), dict(ici or {})
        order = list(dcn) + [n for n in ici if n not in dcn]
        return cls(tuple(MeshAxis(n, int(dcn.get(n, 1)), int(ici.get(n, 1))) for n in order))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name: str) -> MeshAxis:
        for a in self.axes:
            if a.name == name:
                return a
        raise InvalidRequestError(f"mesh has no axis {name!r}; its axes are {list(self.names)}")

    def check_fits(self, gang: GangShape) -> None:
        """Raises ProgramMismatchError unless the mesh covers exactly the gang's devices."""
        dcn = math.prod(a.dcn for a in self.axes)
        ici = math.prod(a.ici for a in self.axes)
        if dcn != gang.num_slices or ici != gang.chips_per_slice:
            raise ProgramMismatchError(
                f"mesh {self.describe()} has {dcn}-way DCN x {ici}-way ICI, but the gang has "
                f"{gang.num_slices} slice(s) of {gang.chips_per_slice} chips: the DCN parts must "
                f"multiply to {gang.num_slices} and the ICI parts to {gang.chips_per_slice}"
            )

    def device_grid(self, gang: GangShape) -> np.ndarray:
        """The global device number at every mesh position (an int array of `self.shape`)."""
        self.check_fits(gang)
        k = len(self.axes)
        ids = np.arange(gang.num_devices).reshape(
            [a.dcn for a in self.axes] + [a.ici for a in self.axes]
        )
        interleaved = [d for i in range(k) for d in (i, k + i)]
        return ids.transpose(interleaved).reshape(self.shape)

    def abstract(self) -> AbstractMesh:
        """The `jax.sharding.AbstractMesh` a client exports programs against."""
        from jax.sharding import AbstractMesh

        return AbstractMesh(self.shape, self.names)

    def describe(self) -> str:
        parts = []
        for a in self.axes:
            kind = "dcn" if a.ici == 1 else "ici" if a.dcn == 1 else f"dcn{a.dcn}*ici{a.ici}"
            parts.append(f"{a.name}={a.size}({kind})")
        return "(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class ShardingSpec:
    """How an array is split over a mesh: for each dimension, the axes it is split over."""

    mesh: MeshSpec
    dims: tuple[tuple[str, ...], ...]

    @classmethod
    def from_partition_spec(cls, mesh: MeshSpec, spec: Iterable[object]) -> ShardingSpec:
        """Converts a `PartitionSpec`-like sequence (None, "axis" or a tuple of axes per dim)."""
        dims: list[tuple[str, ...]] = []
        for entry in spec:
            if entry is None:
                dims.append(())
            elif isinstance(entry, str):
                dims.append((entry,))
            else:
                dims.append(tuple(str(x) for x in cast(Iterable[object], entry)))
        return cls(mesh, tuple(dims))

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the piece of an array of `shape` that each device holds (after
        `check`)."""
        dims = self.dims + ((),) * (len(shape) - len(self.dims))
        return tuple(
            n // math.prod(self.mesh.axis(a).size for a in axes)
            for n, axes in zip(shape, dims, strict=True)
        )

    def partition_spec(self) -> tuple[object, ...]:
        """The dims in `jax.sharding.PartitionSpec` form."""
        return tuple(None if not d else d[0] if len(d) == 1 else d for d in self.dims)

    def check(self, shape: Sequence[int]) -> None:
        """Raises InvalidRequestError unless this sharding can split an array of `shape`."""
        if len(self.dims) > len(shape):
            raise InvalidRequestError(
                f"sharding {self.partition_spec()} has {len(self.dims)} entries but the array "
                f"has only {len(shape)} dimensions {tuple(shape)}"
            )
        seen: set[str] = set()
        for d, axes in enumerate(self.dims):
            for name in axes:
                self.mesh.axis(name)
                if name in seen:
                    raise InvalidRequestError(
                        f"mesh axis {name!r} is used twice in sharding {self.partition_spec()}"
                    )
                seen.add(name)
            ways = math.prod(self.mesh.axis(n).size for n in axes)
            if shape[d] % ways:
                raise InvalidRequestError(
                    f"dimension {d} of shape {tuple(shape)} has size {shape[d]}, which the "
                    f"{ways}-way split over {axes} does not divide evenly"
                )

    def device_indices(self, shape: Sequence[int], gang: GangShape) -> dict[int, Index]:
        """The piece of the global array that each global device holds."""
        self.check(shape)
        grid = self.mesh.device_grid(gang)
        names = self.mesh.names
        result: dict[int, Index] = {}
        for pos in np.ndindex(*grid.shape):
            index = []
            for d, length in enumerate(shape):
                axes = self.dims[d] if d < len(self.dims) else ()
                shard, ways = 0, 1
                for name in axes:
                    i = names.index(name)
                    shard = shard * grid.shape[i] + pos[i]
                    ways *= grid.shape[i]
                step = length // ways
                index.append(slice(shard * step, (shard + 1) * step))
            result[int(grid[pos])] = tuple(index)
        return result

    def process_pieces(self, shape: Sequence[int], gang: GangShape) -> dict[int, list[Index]]:
        """For every process, the distinct pieces its devices hold (replicas sent once)."""
        pieces: dict[int, list[Index]] = {p: [] for p in range(gang.num_processes)}
        for device, index in sorted(self.device_indices(shape, gang).items()):
            own = pieces[gang.process_of(device)]
            if index not in own:
                own.append(index)
        return pieces


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """Rewrites `slice(None)` and friends as explicit `slice(start, stop)` for `shape`."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def index_key(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A hashable form of an index (slices are not hashable before Python 3.12)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
