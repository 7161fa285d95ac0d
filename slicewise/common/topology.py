"""TPU v5e slice types and the `--sim` cluster spec: pure data, no I/O.

The table follows Google's published v5e shapes (Cloud TPU v5e docs): single-host
slices of 1, 4 and 8 chips, and multi-host slices of 4-chip hosts up to 256 chips.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slicewise.common.errors import InvalidRequestError

ACCELERATOR_TYPE = "TPU-V5LITEPOD"

# High-bandwidth memory of one v5e chip (Cloud TPU v5e docs: 16 GiB HBM2 per chip); the
# piece of an array that one chip holds must fit in it.
HBM_BYTES_PER_CHIP = 16 * 2**30


@dataclass(frozen=True)
class SliceType:
    """One v5e slice shape: how many hosts, how many chips on each, the ICI topology."""

    name: str
    chips: int
    hosts: int
    chips_per_host: int
    topology: str

    @property
    def head_resource(self) -> str:
        """The Ray resource that host 0 of such a slice carries (`TPU-<type>-head`)."""
        return f"TPU-{self.name}-head"


def _v5e(chips: int, hosts: int, topology: str) -> SliceType:
    return SliceType(f"v5litepod-{chips}", chips, hosts, chips // hosts, topology)


SLICE_TYPES: dict[str, SliceType] = {
    t.name: t
    for t in (
        _v5e(1, 1, "1x1"),
        _v5e(4, 1, "2x2"),
        _v5e(8, 1, "2x4"),
        _v5e(16, 4, "4x4"),
        _v5e(32, 8, "4x8"),
        _v5e(64, 16, "8x8"),
        _v5e(128, 32, "8x16"),
        _v5e(256, 64, "16x16"),
    )
}


def slice_type(name: str) -> SliceType:
    """Looks up a slice type by name (`v5litepod-16`) or by ICI topology (`4x4`).

    Raises:
        InvalidRequestError: the name is not a v5e slice type.
    """
    key = name.strip().lower()
    if key in SLICE_TYPES:
        return SLICE_TYPES[key]
    for t in SLICE_TYPES.values():
        if t.topology == key:
            return t
    known = ", ".join(SLICE_TYPES)
    raise InvalidRequestError(f"unknown slice type {name!r}; known v5e slice types: {known}")


_SPEC_PART = re.compile(r"^(?:(\d+)x)?(v5litepod-\d+)$")


def parse_sim_spec(spec: str) -> list[SliceType]:
    """Parses a simulated cluster spec such as `2xv5litepod-8` or `v5litepod-16,v5litepod-4`.

    Returns one entry per slice, in order.

    Raises:
        InvalidRequestError: the spec is empty or names an unknown slice type.
    """
    slices: list[SliceType] = []
    for part in (p.strip() for p in spec.split(",")):
        match = _SPEC_PART.match(part.lower())
        if not match:
            raise InvalidRequestError(
                f"bad simulation spec part {part!r} in {spec!r}; expected e.g. "
                "'2xv5litepod-8' or 'v5litepod-16,v5litepod-4'"
            )
        count = int(match.group(1) or 1)
        if count < 1:
            raise InvalidRequestError(f"slice count must be at least 1 in {part!r}")
        slices.extend([slice_type(match.group(2))] * count)
    return slices
