"""Expert parallelism on real workers: the MoE layer with its experts split across the two
slices of a gang, exchanged flat and hierarchically over gloo, against the layer on one
local device.

The program (outputs, stats and the gradients of a loss built from all of them) is
exported on this client against the gang's AbstractMesh, run by the two worker processes
(one per v5litepod-4 slice, 4 CPU devices each), and fetched back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from programs.moe.layer import MoELayerConfig, moe_layer
from programs.moe.sharded import (
    DcnTraffic,
    ExpertParallelism,
    predict_dcn_traffic,
    sharded_moe_layer,
)
from slicewise.client import RemoteArray
from tests.unit.test_moe_layer import D, assert_close, make_inputs
from tests.unit.test_moe_sharded import program_dcn_traffic

pytestmark = pytest.mark.integration

TOKENS, NUM_EXPERTS = 64, 8
# 8 groups of 8 tokens (one per device); capacity 2 per expert per group, so some of the
# k=2 choices are dropped and the comparison covers dropping too.
CFG = MoELayerConfig(k=2, capacity_factor=1.25, group_size=8)
EXPERT_AXES = ("expert_dcn", "expert_ici")
MESHES = {
    # experts over 2 slices x 4 chips
    "e2x4": ({"expert_dcn": 2}, {"expert_ici": 4}, ()),
    # 2-way data inside each slice, experts over 2 slices x 2 chips
    "d2.e2x2": ({"expert_dcn": 2}, {"data": 2, "expert_ici": 2}, ("data",)),
}


def layer_with_grads(layer, r):
    """(y, stats, grads wrt params and x) of a loss that every output and stat feeds."""

    def loss(params, x):
        y, stats = layer(params, x)
        return jnp.sum(y * r) + stats["aux_loss"] + 0.1 * stats["z_loss"], (y, stats)

    def run(params, x):
        (_, (y, stats)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
        return y, stats, grads

    return run


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(seed=11, tokens=TOKENS, num_experts=NUM_EXPERTS)


@pytest.fixture(scope="module")
def one_device(inputs):
    params, x, r = inputs
    return jax.jit(layer_with_grads(lambda p, x: moe_layer(p, x, CFG), r))(params, x)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "mesh_name,strategy",
    [
        ("e2x4", "flat"),
        ("e2x4", "hierarchical"),
        ("e2x4", "packed"),
        ("d2.e2x2", "flat"),
        ("d2.e2x2", "hierarchical"),
    ],
)
def test_experts_split_across_two_slices_equal_one_device(
    two_slices, inputs, one_device, mesh_name, strategy
):
    gang = two_slices
    assert (gang.num_slices, gang.hosts_per_slice, gang.chips_per_host) == (2, 1, 4)
    dcn, ici, data_axes = MESHES[mesh_name]
    mesh = gang.mesh(dcn=dcn, ici=ici)
    # Chunks of 3 rows: the packed exchange loops over several trips and pads the last.
    ep = ExpertParallelism(EXPERT_AXES, data_axes, strategy, expert_slices=2, chunk=3)
    params, x, r = inputs

    experts = mesh.sharding(EXPERT_AXES, None, None)
    remote_params = {
        "router": gang.put(np.asarray(params["router"]), mesh.sharding()),
        "w1": gang.put(np.asarray(params["w1"]), experts),
        "w2": gang.put(np.asarray(params["w2"]), experts),
    }
    tokens = mesh.sharding(ep.token_axes, None)
    remote_x, remote_r = gang.put(np.asarray(x), tokens), gang.put(np.asarray(r), tokens)

    def step(params, x, r):
        layer = lambda p, x: sharded_moe_layer(p, x, CFG, mesh.abstract, ep)  # noqa: E731
        return layer_with_grads(layer, r)(params, x)

    program = gang.compile(jax.jit(step), remote_params, remote_x, remote_r)
    # The shipped program really exchanges between the slices, as much as predicted: once
    # for the forward pass and once more for the backward pass.
    predicted = predict_dcn_traffic(
        mesh.spec, ep, CFG, tokens=TOKENS, d_model=D, num_experts=NUM_EXPERTS
    )
    assert predicted.bytes > 0
    # (Packed sends a routing-dependent number of chunks: its prediction is a bound.)
    assert strategy == "packed" or program_dcn_traffic(
        mesh.spec, program.exported.mlir_module()
    ) == DcnTraffic(2 * predicted.bytes, 2 * predicted.messages)

    y, stats, grads = jax.tree.map(
        lambda a: a.fetch(),
        program(remote_params, remote_x, remote_r),
        is_leaf=lambda a: isinstance(a, RemoteArray),
    )
    ref_y, ref_stats, ref_grads = one_device
    assert_close(y, ref_y, "y")
    np.testing.assert_array_equal(stats["tokens_per_expert"], ref_stats["tokens_per_expert"])
    assert float(stats["dropped_fraction"]) == float(ref_stats["dropped_fraction"]) > 0
    assert_close(stats["aux_loss"], ref_stats["aux_loss"], "aux_loss")
    assert_close(stats["z_loss"], ref_stats["z_loss"], "z_loss")
    for name in ("router", "w1", "w2"):
        assert_close(grads[0][name], ref_grads[0][name], f"d/d{name}")
    assert_close(grads[1], ref_grads[1], "d/dx")
