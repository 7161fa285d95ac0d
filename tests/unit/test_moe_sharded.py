"""`programs.moe.sharded` on 8 CPU devices in one process, against the unsharded layer.

Each mesh is laid out as a gang of slices would be (`MeshSpec.device_grid`), so that axes
meant as DCN really are the slice-major ones. Every strategy must give what `moe_layer`
gives on one device: outputs, every stat, and the gradients of a loss that uses them all,
with the tolerances of `test_moe_layer` (rtol 1e-5, atol 1e-6 of the array's scale). Routing
decisions are compared exactly through `tokens_per_expert` and `dropped_fraction`, and per
slice through `tokens_by_slice` against the unsharded layer on each slice's tokens.
"packed" is also checked to move fewer rows between slices when routing stays local.

The DCN traffic prediction is checked against numbers worked out by hand, and against the
all-to-alls of the lowered program: their replica groups and piece shapes, with each
device's slice read off the mesh.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from programs.base import ConfigError
from programs.moe.layer import MoELayerConfig, expert_capacity, moe_layer, route
from programs.moe.sharded import (
    DcnTraffic,
    ExpertParallelism,
    predict_dcn_traffic,
    sharded_moe_layer,
)
from slicewise.common.mesh import GangShape, MeshSpec
from tests.unit.test_moe_layer import D, assert_close, make_inputs

# The graphs compile once each: XLA's backend optimisations would cost more than they save.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
TOKENS = 64
HIER = ("expert_dcn", "expert_ici")
# Rows per DCN chunk of "packed": a divisor of no block's rows here, so that the exchange
# takes several trips and pads its last chunk.
CHUNK = 3


class Layout(NamedTuple):
    """A mesh laid out on a gang's devices, and the expert/data axes to use on it."""

    spec: MeshSpec
    gang: GangShape
    expert_axes: tuple[str, ...]
    data_axes: tuple[str, ...] = ()

    def mesh(self) -> Mesh:
        grid = self.spec.device_grid(self.gang)
        devices = np.array(jax.devices()[: self.gang.num_devices], dtype=object)[grid]
        return Mesh(devices, self.spec.names)

    def ep(self, strategy: str, chunk: int = CHUNK) -> ExpertParallelism:
        # Every layout's expert group spans two slices.
        return ExpertParallelism(
            self.expert_axes, self.data_axes, strategy, expert_slices=2, chunk=chunk
        )


LAYOUTS = {
    # experts over 2 slices x 2 chips
    "e2x2": Layout(MeshSpec.build({"expert_dcn": 2}, {"expert_ici": 2}), GangShape(2, 1, 2), HIER),
    # experts over 2 slices x 4 chips: the integration test's gang
    "e2x4": Layout(MeshSpec.build({"expert_dcn": 2}, {"expert_ici": 4}), GangShape(2, 1, 4), HIER),
    # 2-way data on ICI, experts over 2 slices x 2 chips
    "d2.e2x2": Layout(
        MeshSpec.build({"expert_dcn": 2}, {"data": 2, "expert_ici": 2}),
        GangShape(2, 1, 4),
        HIER,
        ("data",),
    ),
    # 2-way data across slices too: 4 slices of 2 chips, each expert group on 2 of them
    "d2dcn.e2x2": Layout(
        MeshSpec.build({"data": 2, "expert_dcn": 2}, {"expert_ici": 2}),
        GangShape(4, 1, 2),
        HIER,
        ("data",),
    ),
}
# One expert axis that is itself DCN x ICI (a hybrid axis): only flat applies.
HYBRID = Layout(MeshSpec.build({"expert": 2}, {"expert": 4}), GangShape(2, 1, 4), ("expert",))


def loss_fn(layer, r):
    """A scalar that every output and stat feeds, so its gradients check them all."""

    def loss(params, x):
        y, stats = layer(params, x)
        return jnp.sum(y * r) + stats["aux_loss"] + 0.1 * stats["z_loss"], (y, stats)

    return jit(jax.value_and_grad(loss, (0, 1), has_aux=True))


def inputs_for(cfg: MoELayerConfig, num_experts: int):
    return make_inputs(seed=cfg.k * 10 + num_experts, tokens=TOKENS, num_experts=num_experts)


@functools.cache
def unsharded_reference(cfg: MoELayerConfig, num_experts: int):
    """The unsharded layer's outputs, stats and gradients on `inputs_for(cfg, E)`: the
    same for every mesh and strategy, so computed (and compiled) once per routing."""
    params, x, r = inputs_for(cfg, num_experts)
    return loss_fn(lambda p, x: moe_layer(p, x, cfg), r)(params, x)


def check_against_unsharded(layout: Layout, strategy: str, cfg: MoELayerConfig, num_experts: int):
    params, x, r = inputs_for(cfg, num_experts)
    mesh, ep = layout.mesh(), layout.ep(strategy)

    (_, (y, stats)), grads = loss_fn(lambda p, x: sharded_moe_layer(p, x, cfg, mesh, ep), r)(
        params, x
    )
    (_, (ref_y, ref_stats)), ref_grads = unsharded_reference(cfg, num_experts)

    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(ep.token_axes, None)), 2)
    assert_close(y, ref_y, "y")
    np.testing.assert_array_equal(stats["tokens_per_expert"], ref_stats["tokens_per_expert"])
    np.testing.assert_array_equal(
        np.sum(stats["tokens_by_slice"], axis=0), ref_stats["tokens_per_expert"]
    )
    assert float(stats["dropped_fraction"]) == float(ref_stats["dropped_fraction"])
    assert_close(stats["aux_loss"], ref_stats["aux_loss"], "aux_loss")
    assert_close(stats["z_loss"], ref_stats["z_loss"], "z_loss")
    for name in ("router", "w1", "w2"):
        assert_close(grads[0][name], ref_grads[0][name], f"d/d{name}")
    assert_close(grads[1], ref_grads[1], "d/dx")
    return ref_stats


# Each case compiles two programs; the unsharded layer's own grid (test_moe_layer.py)
# covers every k and capacity factor, so this one keeps the cases that differ in what
# crosses devices: drops with k = 1 and 2, a partly used capacity, and dropless.
ROUTINGS = [(1, 1.0), (2, 1.0), (2, 1.25), (1, None)]  # (k, capacity_factor)


# Packed is hierarchical with another DCN hop: it runs with drops and dropless, not all four.
@pytest.mark.parametrize(
    "strategy,k,capacity_factor",
    [(s, k, cf) for s in ("flat", "hierarchical") for k, cf in ROUTINGS]
    + [("packed", 2, 1.0), ("packed", 1, None)],
)
def test_experts_over_two_slices_of_four_chips_equal_the_unsharded_layer(
    strategy, k, capacity_factor
):
    # 8 groups of 8 tokens, one group per device; E=8, one expert per device. Capacities
    # 1 (drops), 2 (1 * 1.25 rounded up) and 8 (dropless: every token of the group).
    cfg = MoELayerConfig(k=k, capacity_factor=capacity_factor, group_size=8)
    ref_stats = check_against_unsharded(LAYOUTS["e2x4"], strategy, cfg, num_experts=8)
    dropped = float(ref_stats["dropped_fraction"])
    if capacity_factor == 1.0:
        assert dropped > 0  # the comparison covers dropped choices
    if capacity_factor is None:
        assert dropped == 0


@pytest.mark.parametrize(
    "k,capacity_factor,num_experts,group_size",
    [(2, 1.25, 8, 4), (1, None, 16, 8)],
)
@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
@pytest.mark.parametrize("name", ["e2x2", "d2.e2x2", "d2dcn.e2x2"])
def test_other_meshes_equal_the_unsharded_layer(
    name, strategy, k, capacity_factor, num_experts, group_size
):
    # Several groups and several experts per device: 2 to 4 groups of 4 or 8 tokens, 2 or
    # 4 of E=8 or 16 experts.
    cfg = MoELayerConfig(k=k, capacity_factor=capacity_factor, group_size=group_size)
    check_against_unsharded(LAYOUTS[name], strategy, cfg, num_experts)


@pytest.mark.parametrize("name", ["e2x2", "d2.e2x2"])
def test_packed_on_other_meshes_equals_the_unsharded_layer(name):
    # Several experts and groups per device, and data parallelism beside the experts.
    cfg = MoELayerConfig(k=2, capacity_factor=1.25, group_size=4)
    check_against_unsharded(LAYOUTS[name], "packed", cfg, num_experts=8)


@pytest.mark.parametrize("k,capacity_factor", [(2, 1.0), (1, None)])
def test_flat_over_one_hybrid_axis_equals_the_unsharded_layer(k, capacity_factor):
    cfg = MoELayerConfig(k=k, capacity_factor=capacity_factor, group_size=8)
    check_against_unsharded(HYBRID, "flat", cfg, num_experts=16)


def test_renormalize_off_and_bfloat16_experts_match_unsharded():
    # bfloat16 experts: the same dtype on both sides, so the same roundings in the experts;
    # only the order of the stats' sums differs.
    cfg = MoELayerConfig(k=2, capacity_factor=1.25, renormalize=False, group_size=8)
    check_against_unsharded(LAYOUTS["e2x4"], "hierarchical", cfg, num_experts=8)
    cfg16 = MoELayerConfig(k=2, capacity_factor=1.25, group_size=8, dtype="bfloat16")
    params, x, _ = make_inputs(seed=3, tokens=TOKENS, num_experts=8)
    mesh, ep = LAYOUTS["e2x4"].mesh(), LAYOUTS["e2x4"].ep("hierarchical")
    y, stats = jit(lambda p, x: sharded_moe_layer(p, x, cfg16, mesh, ep))(params, x)
    ref_y, ref_stats = jit(lambda p, x: moe_layer(p, x, cfg16))(params, x)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(stats["tokens_per_expert"], ref_stats["tokens_per_expert"])
    np.testing.assert_allclose(y, ref_y, rtol=1e-2, atol=1e-2)


# -- routing per slice, and what packed sends ------------------------------------------------


@pytest.mark.parametrize("strategy", ["hierarchical", "packed"])
def test_tokens_by_slice_are_the_unsharded_layer_on_each_slices_tokens(strategy):
    # e2x4 with no data axes: tokens split over (expert_dcn, expert_ici) major-first, so
    # slice 0 holds tokens [0, 32) and slice 1 [32, 64), four whole groups of 8 each.
    cfg = MoELayerConfig(k=2, capacity_factor=1.0, group_size=8)
    params, x, _ = make_inputs(seed=5, tokens=TOKENS, num_experts=8)
    mesh, ep = LAYOUTS["e2x4"].mesh(), LAYOUTS["e2x4"].ep(strategy)
    _, stats = jit(lambda p, x: sharded_moe_layer(p, x, cfg, mesh, ep))(params, x)
    by_slice = np.asarray(stats["tokens_by_slice"])
    assert by_slice.shape == (2, 8) and by_slice.dtype == np.int32
    half = TOKENS // 2
    for s in range(2):
        _, ref = jit(lambda p, x: moe_layer(p, x, cfg))(params, x[s * half : (s + 1) * half])
        np.testing.assert_array_equal(by_slice[s], ref["tokens_per_expert"], f"slice {s}")
    # Experts 0-3 live on slice 0, 4-7 on slice 1.
    local = by_slice[0, :4].sum() + by_slice[1, 4:].sum()
    assert float(stats["local_fraction"]) == pytest.approx(local / by_slice.sum())


def test_tokens_by_slice_of_one_slice_is_tokens_per_expert():
    cfg = MoELayerConfig(k=2, capacity_factor=1.0, group_size=8)
    params, x, _ = make_inputs(seed=5, tokens=TOKENS, num_experts=8)
    layout = LAYOUTS["e2x4"]
    ep = ExpertParallelism(layout.expert_axes, strategy="flat")
    _, stats = jit(lambda p, x: sharded_moe_layer(p, x, cfg, layout.mesh(), ep))(params, x)
    np.testing.assert_array_equal(stats["tokens_by_slice"], stats["tokens_per_expert"][None])
    assert float(stats["local_fraction"]) == 1.0


def expected_dcn_rows(params, x, cfg: MoELayerConfig, slices: int, chips: int) -> int:
    """The most used rows a device of e2x4-like meshes (no data axes) sends to one other
    slice, from the unsharded routing: device (s0, i) holds the groups of block s0 * I + i,
    expert (s, j, e_l) lives on device (s, j); chip j of slice s0 gathers, for slice s,
    the used slots of every chip i of its slice for the experts on (s, j)."""
    num_experts = params["router"].shape[1]
    groups = TOKENS // cfg.group_size
    logits = np.asarray(x, np.float64) @ np.asarray(params["router"], np.float64)
    capacity = expert_capacity(cfg, cfg.group_size, num_experts)
    routing = route(jnp.asarray(logits.reshape(groups, cfg.group_size, num_experts)), cfg, capacity)
    counts = np.asarray(routing.dispatch).sum(axis=(1, 3))  # [G, E]
    c = counts.reshape(slices, chips, -1, slices, chips, num_experts // (slices * chips))
    rows = np.einsum("aigbje->ajb", c)  # [from slice, lane, to slice]
    return max(int(rows[a, :, b].max()) for a in range(slices) for b in range(slices) if a != b)


@pytest.mark.parametrize("k", [1, 2])
def test_packed_moves_fewer_rows_between_slices_when_routing_is_local(k):
    # Feature 0 says which slice holds a token (+ on slice 0, - on slice 1) and the router
    # reads it as a preference for slice 0's experts (0-3) or slice 1's (4-7); a negative
    # weight sends every token's preference to the other slice. A mild preference (one
    # logit) lets some choices cross slices either way; a strong one keeps them all home,
    # and the loop runs no trip at all. Dropless: C = 8, and a block is
    # I * E_l * G_l * C = 4 * 1 * 1 * 8 = 32 rows.
    cfg = MoELayerConfig(k=k, capacity_factor=None, group_size=8)
    params, x, r = make_inputs(seed=7, tokens=TOKENS, num_experts=8)
    x = x.at[:, 0].set(jnp.where(jnp.arange(TOKENS) < TOKENS // 2, 2.0, -2.0))
    layout = LAYOUTS["e2x4"]
    mesh, ep = layout.mesh(), layout.ep("packed")
    sharded = loss_fn(lambda p, x: sharded_moe_layer(p, x, cfg, mesh, ep), r)
    unsharded = loss_fn(lambda p, x: moe_layer(p, x, cfg), r)
    rows = {}
    for case, weight in (("local", 0.5), ("remote", -0.5), ("all local", 3.0)):
        bias = weight * jnp.where(jnp.arange(8) < 4, 1.0, -1.0)
        p = {**params, "router": params["router"].at[0].set(bias)}
        (_, (y, stats)), grads = sharded(p, x)
        (_, (ref_y, ref_stats)), ref_grads = unsharded(p, x)
        assert_close(y, ref_y, f"y ({case})")
        np.testing.assert_array_equal(stats["tokens_per_expert"], ref_stats["tokens_per_expert"])
        for name in ("router", "w1", "w2"):
            assert_close(grads[0][name], ref_grads[0][name], f"d/d{name} ({case})")
        assert_close(grads[1], ref_grads[1], f"d/dx ({case})")
        rows[case] = int(stats["dcn_rows"])
        assert rows[case] == expected_dcn_rows(p, x, cfg, slices=2, chips=4), case
    assert 0 < rows["local"] < rows["remote"] < 32
    assert rows["all local"] == 0
    # The loop's trips, ceil(rows / chunk), fall with them.
    assert -(-rows["local"] // CHUNK) < -(-rows["remote"] // CHUNK)


# -- configuration errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"expert_axes": ()}, "at least one mesh axis"),
        ({"expert_axes": ("e",), "strategy": "ring"}, "strategy='ring'"),
        ({"expert_axes": ("e",), "strategy": "hierarchical"}, r"expert_axes=\(dcn_axis"),
        ({"expert_axes": ("e", "d"), "data_axes": ("d",)}, "appears twice"),
        ({"expert_axes": ("e",), "strategy": "packed"}, r"packed strategy needs expert_axes"),
        ({"expert_axes": ("e", "i"), "strategy": "packed", "chunk": 0}, "chunk=0"),
        ({"expert_axes": ("e", "i"), "chunk": 2.5}, "chunk=2.5"),
    ],
)
def test_expert_parallelism_refuses_bad_axes(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ExpertParallelism(**kwargs)


def test_a_single_axis_name_is_taken_as_a_tuple():
    ep = ExpertParallelism("expert", "data")
    assert (ep.expert_axes, ep.data_axes, ep.token_axes) == (
        ("expert",),
        ("data",),
        ("data", "expert"),
    )


def test_sizes_that_cannot_split_are_refused():
    layout = LAYOUTS["e2x4"]
    mesh, ep = layout.mesh(), layout.ep("flat")
    params, x, _ = make_inputs(seed=0, tokens=TOKENS, num_experts=8)
    with pytest.raises(ConfigError, match="do not split into whole groups"):
        sharded_moe_layer(params, x, MoELayerConfig(group_size=16), mesh, ep)
    with pytest.raises(ConfigError, match="do not split into whole groups"):
        sharded_moe_layer(params, x, MoELayerConfig(), mesh, ep)  # one group of all tokens
    params12, _, _ = make_inputs(seed=0, tokens=TOKENS, num_experts=12)
    with pytest.raises(ConfigError, match="12 experts do not split evenly"):
        sharded_moe_layer(params12, x, MoELayerConfig(group_size=8), mesh, ep)
    with pytest.raises(ConfigError, match="mesh has no axis"):
        sharded_moe_layer(
            params, x, MoELayerConfig(group_size=8), mesh, ExpertParallelism(("expert",))
        )
    with pytest.raises(ConfigError, match="do not fit x"):
        sharded_moe_layer(params, x[:, :4], MoELayerConfig(group_size=8), mesh, ep)


# -- DCN traffic -------------------------------------------------------------------------------


def predict(
    layout: Layout, strategy: str, cfg: MoELayerConfig, num_experts: int, chunk: int = CHUNK
) -> DcnTraffic:
    return predict_dcn_traffic(
        layout.spec,
        layout.ep(strategy, chunk),
        cfg,
        tokens=TOKENS,
        d_model=D,
        num_experts=num_experts,
    )


def test_dcn_traffic_by_hand():
    # e2x4, T=64 in groups of 8, E=8, C=1, f32: a device's buffer is E*G_l*C*D = 8*1*1*8
    # floats = 256 bytes, 32 bytes per destination. Per direction: flat, each of 8 devices
    # sends to the 4 devices of the other slice, 32 messages of 32 bytes = 1024 bytes;
    # hierarchical, the ICI step stays in the slice and each device sends the other
    # slice's half (4 blocks, 128 bytes) in one message: 8 messages, 1024 bytes.
    cfg = MoELayerConfig(k=2, capacity_factor=1.0, group_size=8)
    e2x4 = LAYOUTS["e2x4"]
    assert predict(e2x4, "flat", cfg, 8) == DcnTraffic(bytes=2 * 1024, messages=2 * 32)
    assert predict(e2x4, "hierarchical", cfg, 8) == DcnTraffic(bytes=2 * 1024, messages=2 * 8)

    # bfloat16 halves the bytes; dropless (C = T_g = 8) multiplies them by 8.
    cfg16 = MoELayerConfig(k=2, capacity_factor=1.0, group_size=8, dtype="bfloat16")
    assert predict(e2x4, "flat", cfg16, 8) == DcnTraffic(bytes=1024, messages=64)
    dropless = MoELayerConfig(k=2, capacity_factor=None, group_size=8)
    assert predict(e2x4, "hierarchical", dropless, 8) == DcnTraffic(bytes=16384, messages=16)

    # The same as one hybrid axis: flat only, the same numbers as flat above.
    assert predict(HYBRID, "flat", cfg, 8) == DcnTraffic(bytes=2048, messages=64)

    # d2dcn.e2x2, E=16, groups of 8, k=1, C=2: 8 devices, buffer 16*1*2*8*4 = 1024 bytes,
    # 256 bytes per block of the 4-device expert group. Flat: 2 remote peers per device,
    # 16 messages, 4096 bytes per direction; hierarchical: 1 remote peer per device, a
    # 512-byte message, 8 messages and 4096 bytes.
    cfg2 = MoELayerConfig(k=1, capacity_factor=1.25, group_size=8)
    d2dcn = LAYOUTS["d2dcn.e2x2"]
    assert predict(d2dcn, "flat", cfg2, 16) == DcnTraffic(bytes=8192, messages=32)
    assert predict(d2dcn, "hierarchical", cfg2, 16) == DcnTraffic(bytes=8192, messages=16)

    # Experts inside a slice, data across slices: nothing crosses DCN.
    in_slice = Layout(
        MeshSpec.build({"data": 2}, {"expert": 4}), GangShape(2, 1, 4), ("expert",), ("data",)
    )
    assert predict(in_slice, "flat", cfg, 8) == DcnTraffic(bytes=0, messages=0)


def test_packed_dcn_traffic_bound_by_hand():
    # e2x4 as above: a DCN block is I * E_l * G_l * C = 4 rows of 32 bytes. The counts
    # (E * G_l = 8 int32, 32 bytes per device) cross once: 8 messages of 16 bytes.
    cfg = MoELayerConfig(k=2, capacity_factor=1.0, group_size=8)
    e2x4 = LAYOUTS["e2x4"]
    counts = DcnTraffic(bytes=128, messages=8)
    # A chunk of at least a block: one trip per direction, hierarchical's traffic.
    for chunk in (4, 64):
        assert predict(e2x4, "packed", cfg, 8, chunk) == DcnTraffic(2 * 1024 + 128, 16 + 8)
    # Chunks of 3 rows: 2 trips, the second padded: 8 messages of 3 * 32 bytes each way,
    # twice per direction.
    bound = DcnTraffic(bytes=2 * 2 * 8 * 96 + counts.bytes, messages=2 * 2 * 8 + counts.messages)
    assert predict(e2x4, "packed", cfg, 8, 3) == bound
    # Chunks of 1 row: 4 trips, no padding: hierarchical's bytes, 4 times its messages.
    assert predict(e2x4, "packed", cfg, 8, 1) == DcnTraffic(2 * 1024 + 128, 4 * 16 + 8)


_A2A = re.compile(
    r'"stablehlo.all_to_all".*replica_groups = dense<(?P<groups>[\[\]\d, ]*)>.*'
    r"split_count = (?P<split>\d+).*: \(tensor<(?P<shape>[\dx]+)x(?P<dtype>\w+)>\)"
)
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}


def program_dcn_traffic(spec: MeshSpec, stablehlo: str) -> DcnTraffic:
    """Bytes and messages between slices of the all-to-alls in a lowered program.

    Each all_to_all splits its operand into `split_count` pieces and sends piece j to the
    j-th device of each replica group. Replica group entries are positions in the mesh's
    flattened device array; a device's slice is the DCN part of its mesh coordinates.
    """

    def slice_of(position: int) -> tuple[int, ...]:
        coords = np.unravel_index(position, spec.shape)
        return tuple(int(c) // axis.ici for c, axis in zip(coords, spec.axes, strict=True))

    total, found = DcnTraffic(0, 0), 0
    for line in stablehlo.splitlines():
        match = _A2A.search(line)
        if not match:
            continue
        found += 1
        groups = json.loads(match["groups"])
        if not isinstance(groups[0], list):  # a single group prints as one flat list
            groups = [groups]
        elements = math.prod(int(n) for n in match["shape"].split("x"))
        piece = elements * _BYTES[match["dtype"]] // int(match["split"])
        for group in groups:
            assert len(group) == int(match["split"]), line
            for src in group:
                for dst in group:
                    if slice_of(src) != slice_of(dst):
                        total = DcnTraffic(total.bytes + piece, total.messages + 1)
    assert found, "no all_to_all in the lowered program"
    return total


@pytest.mark.parametrize(
    "name,strategy,num_experts,cfg",
    [
        ("e2x4", "flat", 8, MoELayerConfig(k=2, capacity_factor=1.0, group_size=8)),
        ("e2x4", "hierarchical", 8, MoELayerConfig(k=2, capacity_factor=1.0, group_size=8)),
        ("d2dcn.e2x2", "flat", 16, MoELayerConfig(k=1, capacity_factor=None, group_size=4)),
        ("d2dcn.e2x2", "hierarchical", 16, MoELayerConfig(k=1, capacity_factor=None, group_size=4)),
        ("d2.e2x2", "hierarchical", 8, MoELayerConfig(k=2, group_size=8, dtype="bfloat16")),
        ("e2x4", "packed", 8, MoELayerConfig(k=2, capacity_factor=1.0, group_size=8)),
        ("d2dcn.e2x2", "packed", 16, MoELayerConfig(k=1, capacity_factor=None, group_size=4)),
        ("d2.e2x2", "packed", 8, MoELayerConfig(k=2, group_size=8, dtype="bfloat16")),
    ],
)
def test_dcn_traffic_prediction_matches_the_programs_all_to_alls(name, strategy, num_experts, cfg):
    # For packed, a chunk as large as a block: the program then holds each loop's one
    # all_to_all once, as many as the bound counts (one trip). The chunked bound itself is
    # checked by hand above.
    chunk = 1 << 20
    layout = LAYOUTS[name]
    params, x, _ = make_inputs(seed=0, tokens=TOKENS, num_experts=num_experts)
    mesh, ep = layout.mesh(), layout.ep(strategy, chunk)
    # The lowered StableHLO is what `jax.export` ships to workers. (XLA:CPU's compiled
    # all-to-alls would not do: it widens bfloat16 to float32 for collectives.)
    layer = lambda p, x: sharded_moe_layer(p, x, cfg, mesh, ep)  # noqa: E731
    predicted = predict(layout, strategy, cfg, num_experts, chunk)
    assert predicted.messages > 0
    forward = jax.jit(layer).lower(params, x).as_text()
    assert program_dcn_traffic(layout.spec, forward) == predicted
    # The backward pass runs the transposed exchanges: as much again, but for packed's
    # routing counts (what it adds to hierarchical here), which have no cotangent.
    counts = DcnTraffic(0, 0)
    if strategy == "packed":
        payload = predict(layout, "hierarchical", cfg, num_experts)
        counts = DcnTraffic(predicted.bytes - payload.bytes, predicted.messages - payload.messages)
        assert counts.messages > 0
    loss = lambda p, x: jnp.sum(layer(p, x)[0])  # noqa: E731
    both = jax.jit(jax.grad(loss, (0, 1))).lower(params, x).as_text()
    assert program_dcn_traffic(layout.spec, both) == DcnTraffic(
        2 * predicted.bytes - counts.bytes, 2 * predicted.messages - counts.messages
    )
