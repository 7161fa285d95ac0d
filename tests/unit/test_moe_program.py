"""The `moe` program on its own: config checks, where its weights go, and how its step
reports routing beside the loss. (That the sharded step trains as the one-device
reference does is tests/integration/test_moe_training.py, across two worker processes.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from controller.jobs import _export, step_record
from programs.base import (
    ConfigError,
    ParallelAxes,
    get_program,
    make_flat_train_fns,
)
from programs.moe import model
from programs.moe.config import SMALL_MOE_OVERRIDES

PROGRAM = get_program("moe")
STEPS = 3


def config(**overrides):
    return PROGRAM.make_config(SMALL_MOE_OVERRIDES | {k: str(v) for k, v in overrides.items()})


def two_slices():
    """(mesh, axes): `expert` across two slices (DCN), `fsdp` over four chips in each."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("expert", "fsdp"))
    axes = ParallelAxes.for_mesh(mesh, data=(), fsdp="fsdp", expert="expert", dcn={"expert": 2})
    return mesh, axes


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_layers": 3, "moe_every": 2}, "multiple of moe_every"),
        ({"dispatch": "ring"}, "dispatch='ring'"),
        ({"group_size": 24}, "group_size=24 must divide the 256 tokens"),
        ({"capacity_factor": -1}, "capacity_factor=-1.0"),
        ({"k": 3}, "k=3 must be 1 or 2"),
        ({"n_experts": 0}, "n_experts=0"),
    ],
)
def test_bad_configs_say_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(**overrides)


def test_every_moe_every_th_layer_has_experts_and_they_split_over_expert_and_fsdp():
    cfg = config(n_layers=4, moe_every=2)
    assert [cfg.is_moe(i) for i in range(4)] == [False, True, False, True]
    assert cfg.layer.capacity_factor == 2.0 and cfg.layer.group_size == cfg.seq_len
    assert config(capacity_factor=0).layer.capacity_factor is None  # dropless
    _, axes = two_slices()
    specs = model.param_partition(cfg, axes)
    assert specs["moe"]["w1"] == P(None, ("expert", "fsdp"), None, None)
    assert specs["moe"]["router"] == P()
    assert set(specs["dense"]) == {"w_in", "w_out"}
    assert "dense" not in model.param_partition(config(moe_every=1), axes)
    ep = model.expert_parallelism(cfg, axes)
    assert (ep.expert_axes, ep.data_axes, ep.expert_slices) == (("expert", "fsdp"), (), 2)
    alone = model.expert_parallelism(config(experts_over_fsdp=False), axes)
    assert (alone.expert_axes, alone.data_axes) == (("expert",), ("fsdp",))


def test_meshes_the_experts_cannot_use_are_refused():
    _, axes = two_slices()
    with pytest.raises(ConfigError, match="n_experts=4 does not split over the 8 devices"):
        model.param_partition(config(n_experts=4), axes)
    inside = ParallelAxes(data=("data",), fsdp="fsdp", sizes=(("data", 2), ("fsdp", 4)))
    with pytest.raises(ConfigError, match="dispatch=hierarchical needs an 'expert' mesh axis"):
        model.param_partition(config(dispatch="hierarchical"), inside)


def test_the_exported_step_packs_routing_after_the_metrics_and_the_record_unpacks_it():
    cfg = config()
    mesh, axes = two_slices()
    exported = _export(make_flat_train_fns, PROGRAM, cfg, mesh.abstract_mesh, axes, "cpu")
    layers, experts = cfg.n_moe_layers, cfg.n_experts
    assert exported.stat_shapes == {
        "dropped_fraction": (layers,),
        "local_fraction": (layers,),
        "tokens_by_slice": (layers, 2, experts),
        "tokens_per_expert": (layers, experts),
    }
    step = jax.export.deserialize(exported.step)
    assert step.out_avals[-1].shape == (3 + 2 * layers + 3 * layers * experts,)

    counts = np.arange(layers * experts, dtype=np.float32)
    by_slice = np.stack([counts // 2, counts - counts // 2], axis=1)  # [layers*E, 2]
    by_slice = by_slice.reshape(layers, experts, 2).transpose(0, 2, 1).ravel()
    vector = np.concatenate([[1.5, 3e-4, 2.25], [0.25] * layers, [0.75] * layers, by_slice, counts])
    record = step_record(4, vector, {0: (0, 10**9)}, tokens=256, stat_shapes=exported.stat_shapes)
    assert record.loss == 2.25
    assert [e.layer for e in record.experts] == list(range(layers))
    assert record.experts[0].tokens_per_expert == tuple(range(experts))
    assert (record.experts[0].dropped_fraction, record.experts[0].local_fraction) == (0.25, 0.75)
    halves = record.experts[0].tokens_by_slice
    assert tuple(a + b for a, b in zip(*halves, strict=True)) == tuple(range(experts))
    assert halves[0] == tuple(n // 2 for n in range(experts))
    with pytest.raises(ValueError, match="reported 3 statistics"):
        step_record(4, vector[:6], {0: (0, 1)}, tokens=1, stat_shapes=exported.stat_shapes)
