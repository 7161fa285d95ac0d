"""What the controller checks in a program's StableHLO before any worker sees it.

A `jax.export` artifact is a StableHLO module. A client can send any bytes, so the
controller reads the module itself rather than trusting how it was made:

- Only ops of the dialects `jax.export` emits (stablehlo, chlo, func, sdy, builtin).
- No custom call outside JAX's list of targets guaranteed stable for export (LAPACK,
  sharding markers, ...). Everything else is refused, and above all the host callbacks
  (`xla_python_cpu_callback`, `xla_ffi_python_cpu_callback`): their backend config holds
  a pointer that the worker would call, so a crafted module could run code there.
- A per-device memory estimate against a v5e chip's HBM (16 GiB). Without compiling for
  the gang's devices, the controller cannot know the peak; it computes a lower bound,
  the largest of three amounts every device must hold at some moment:
  its shards of all the inputs (all live when the program starts), its shards of all
  the outputs (all live when it ends), and the largest single value of the computation
  spread evenly over every device. A program over that bound can never run; one under
  it may still run out of memory on the chips, which XLA then reports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slicewise.common.errors import CapacityError, InvalidRequestError
from slicewise.common.topology import HBM_BYTES_PER_CHIP

ALLOWED_DIALECTS = frozenset({"builtin", "func", "stablehlo", "chlo", "sdy"})


def _stable_custom_calls() -> frozenset[str]:
    # JAX's own list of the targets an exported module may call (jax/_src/export).
    from jax._src.export import _export

    return frozenset(_export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE)


@dataclass(frozen=True)
class ModuleFacts:
    """What the check learned of a module, in bytes per device."""

    input_bytes: int
    output_bytes: int
    largest_value_bytes: int  # the largest value of the computation, whole
    num_devices: int

    @property
    def device_bytes(self) -> int:
        """The lower bound of the module's peak memory on each device (see above)."""
        spread = math.ceil(self.largest_value_bytes / max(self.num_devices, 1))
        return max(self.input_bytes, self.output_bytes, spread)


def _element_bytes(element_type: str) -> int:
    """Bytes per element of an MLIR element type such as f32, bf16, i1, complex<f64>."""
    bits = [int(b) for b in re.findall(r"(\d+)", element_type)] or [32]
    size = max(1, math.ceil(bits[0] / 8))
    return 2 * size if element_type.startswith("complex") else size


def _tensor_bytes(tensor_type: Any) -> int:
    if any(d < 0 for d in tensor_type.shape):  # dynamic: refused elsewhere
        return 0
    return math.prod(tensor_type.shape) * _element_bytes(str(tensor_type.element_type))


def _shard_factors(attrs: Any, rank: int, meshes: dict[str, dict[str, int]]) -> list[int]:
    """How many pieces each dimension of a value is split into, from its sdy.sharding or
    mhlo.sharding attribute (no attribute, or one not understood: not split)."""
    factors = [1] * rank
    if attrs is None:
        return factors
    if "sdy.sharding" in attrs:
        text = str(attrs["sdy.sharding"])
        found = re.match(r"#sdy\.sharding<@([\w.$-]+),\s*\[(.*?)\]", text)
        if found and found.group(1) in meshes:
            sizes = meshes[found.group(1)]
            groups = re.findall(r"\{([^}]*)\}", found.group(2))
            for d, group in enumerate(groups[:rank]):
                for axis, _, sub in re.findall(r'"([^"]+)"(?::\((\d+)\)(\d+))?', group):
                    factors[d] *= int(sub) if sub else sizes.get(axis, 1)
        return factors
    if "mhlo.sharding" in attrs:
        found = re.search(r"devices=\[([\d,]+)\]", str(attrs["mhlo.sharding"]))
        if found:
            tiles = [int(t) for t in found.group(1).split(",")]
            factors = (tiles + [1] * rank)[:rank]
    return factors


def _sharded_bytes(types: Sequence[Any], attrs: Sequence[Any], meshes: Any, ir: Any) -> int:
    total = 0
    for i, t in enumerate(types):
        if not isinstance(t, ir.RankedTensorType):
            continue
        whole = _tensor_bytes(t)
        factors = _shard_factors(attrs[i] if i < len(attrs) else None, len(t.shape), meshes)
        pieces = [math.ceil(n / f) for n, f in zip(t.shape, factors, strict=True)]
        per_element = whole // max(math.prod(t.shape), 1) if whole else 0
        total += math.prod(pieces) * per_element
    return total


def check_module(mlir_text: str, num_devices: int, name: str) -> ModuleFacts:
    """Reads the StableHLO text of an exported program (`Exported.mlir_module()`).

    Raises:
        InvalidRequestError: the module does not parse, uses an op of another dialect, or
            calls a custom-call target outside the stable list.
        CapacityError: each device would need more than a v5e chip's HBM.
    """
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    stable = _stable_custom_calls()
    refused: list[str] = []
    meshes: dict[str, dict[str, int]] = {}
    largest = 0
    main: Any = None
    with mlir.make_ir_context():
        try:
            module = ir.Module.parse(mlir_text)
        except Exception as exc:  # noqa: BLE001 - any failure here means a bad module
            raise InvalidRequestError(
                f"program {name!r}: its StableHLO module does not parse "
                f"({type(exc).__name__}: {str(exc)[:200]}); send the bytes of "
                "jax.export.export(...)(...).serialize()"
            ) from None

        def visit(op: Any) -> Any:
            nonlocal largest, main
            kind = op.name
            if kind.split(".", 1)[0] not in ALLOWED_DIALECTS:
                refused.append(f"op {kind}")
            elif kind == "stablehlo.custom_call":
                target = ir.StringAttr(op.attributes["call_target_name"]).value
                if target not in stable:
                    refused.append(f"custom call {target!r}")
            elif kind == "sdy.mesh":
                text = str(op.attributes["mesh"])
                meshes[ir.StringAttr(op.attributes["sym_name"]).value] = {
                    a: int(n) for a, n in re.findall(r'"([^"]+)"=(\d+)', text)
                }
            elif kind == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                main = op
            for result in op.results:
                if isinstance(result.type, ir.RankedTensorType):
                    largest = max(largest, _tensor_bytes(result.type))
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        if refused:
            shown = sorted(set(refused))
            raise InvalidRequestError(
                f"program {name!r} uses {', '.join(shown[:5])}"
                + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
                + "; a program may use only StableHLO ops and the custom calls jax.export "
                "allows without disabled safety checks (no host callbacks: use a separate "
                "program and fetch in between)"
            )
        if main is None:
            raise InvalidRequestError(
                f"program {name!r} has no public function @main; send the bytes of "
                "jax.export.export(...)(...).serialize()"
            )
        signature = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)

        def attrs_of(key: str) -> list[Any]:
            if key not in main.attributes:
                return []
            return [ir.DictAttr(a) for a in ir.ArrayAttr(main.attributes[key])]

        facts = ModuleFacts(
            input_bytes=_sharded_bytes(signature.inputs, attrs_of("arg_attrs"), meshes, ir),
            output_bytes=_sharded_bytes(signature.results, attrs_of("res_attrs"), meshes, ir),
            largest_value_bytes=largest,
            num_devices=num_devices,
        )
    if facts.device_bytes > HBM_BYTES_PER_CHIP:
        gib = 2**30
        raise CapacityError(
            f"program {name!r} needs at least {facts.device_bytes / gib:.3g} GiB on each of "
            f"its {num_devices} devices, more than the {HBM_BYTES_PER_CHIP / gib:.3g} GiB of "
            f"HBM a v5e chip has (its inputs' shards take {facts.input_bytes / gib:.3g} GiB, "
            f"its outputs' {facts.output_bytes / gib:.3g} GiB, and its largest value "
            f"{facts.largest_value_bytes / gib:.3g} GiB over all devices); shard it over "
            "more devices or make it smaller"
        )
    return facts
