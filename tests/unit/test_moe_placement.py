"""Load-aware expert placement: the controller's plan from per-slice routing
(`controller.placement`) and the move itself (`permute_experts`), which must leave what the
model computes, and so its training, as it was. (The move on a running two-slice job, with
the DCN bytes it saves, is tests/integration/test_moe_placement.py.)"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from controller.journal import ExpertLoad
from controller.placement import plan, routing_by_slice
from programs.base import _init, get_program, train_step
from programs.moe import model
from programs.moe.config import SMALL_MOE_OVERRIDES

PROGRAM = get_program("moe")


def config(**overrides):
    return PROGRAM.make_config(SMALL_MOE_OVERRIDES | {k: str(v) for k, v in overrides.items()})


def local_share(by_slice: np.ndarray, order: np.ndarray) -> float:
    """Brute force: the share of choices on their own slice with position p holding
    expert order[l, p]."""
    layers, slices, experts = by_slice.shape
    local = sum(
        by_slice[layer, p // (experts // slices), order[layer, p]]
        for layer in range(layers)
        for p in range(experts)
    )
    return local / by_slice.sum()


def test_a_skewed_layer_gets_each_slices_favourite_experts():
    # Slice 0's tokens choose experts 4-7, slice 1's choose 0-3: every choice crosses.
    by_slice = np.array([[[0, 0, 1, 0, 9, 9, 9, 9], [9, 9, 9, 9, 0, 1, 0, 0]]])
    placement = plan(by_slice, min_gain=0.05)
    assert placement is not None
    assert set(placement.order[0, :4]) == {4, 5, 6, 7}
    assert set(placement.order[0, 4:]) == {0, 1, 2, 3}
    assert placement.local_before == pytest.approx(local_share(by_slice, np.arange(8)[None]))
    assert placement.local_after == pytest.approx(72 / 74)
    assert placement.moved == 8


def test_the_plan_is_the_best_placement_and_keeps_experts_put_on_ties():
    rng = np.random.default_rng(3)
    by_slice = rng.integers(0, 20, size=(2, 2, 6))
    placement = plan(by_slice, min_gain=0.0)
    assert placement is not None
    for layer in range(2):  # layers place their experts independently
        one = by_slice[layer : layer + 1]
        best = max(local_share(one, np.array([p])) for p in itertools.permutations(range(6)))
        assert local_share(one, placement.order[layer : layer + 1]) == pytest.approx(best)
    # With every placement as good, the experts stay where they are.
    uniform = np.ones((1, 2, 4), np.int64)
    assert plan(uniform, min_gain=0.0) is None  # nothing to gain: nothing moves


def test_small_gains_and_empty_windows_move_nothing():
    slight = np.array([[[5, 5, 6, 5], [5, 5, 5, 5]]])  # 1 choice of 41 to gain
    assert plan(slight, min_gain=0.05) is None
    assert plan(slight, min_gain=0.0) is not None
    assert plan(np.zeros((1, 2, 4), np.int64)) is None
    with pytest.raises(ValueError, match="6 experts do not split over 4 slices"):
        plan(np.ones((1, 4, 6)))
    with pytest.raises(ValueError, match=r"\[layers, slices, experts\]"):
        plan(np.ones((2, 4)))


def test_routing_sums_over_steps_and_needs_the_per_slice_split():
    step = (ExpertLoad(0, (3, 3), 0.0, 0.5, ((1, 2), (2, 1))),)
    total = routing_by_slice([step, step])
    assert total.tolist() == [[[2, 4], [4, 2]]]
    assert routing_by_slice([(ExpertLoad(0, (3, 3), 0.0, 0.5),)]) is None
    assert routing_by_slice([()]) is None


def test_moving_experts_changes_where_they_are_not_what_training_computes():
    cfg = config(moe_every=1, capacity_factor=1.0)  # two MoE layers; drops some choices
    optimizer = PROGRAM.optimizer(cfg)
    step = jax.jit(lambda p, o, b: train_step(PROGRAM, cfg, optimizer, p, o, b))
    params, opt_state = _init(PROGRAM, cfg, optimizer, jax.random.PRNGKey(0))
    params, opt_state, _ = step(params, opt_state, PROGRAM.global_batch(cfg, 0))
    order = np.stack([np.random.default_rng(i).permutation(cfg.n_experts) for i in range(2)])
    permute = jax.jit(lambda p, o, order: PROGRAM.permute_experts(cfg, p, o, order))
    moved_params, moved_opt = permute(params, opt_state, jnp.asarray(order))
    # The moments moved with their weights: Adam's mu of w1 follows w1.
    mu = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))]
    moved_mu = [s for s in jax.tree.leaves(moved_opt, is_leaf=lambda x: hasattr(x, "mu"))]
    adam = next(s for s in mu if hasattr(s, "mu"))
    moved_adam = next(s for s in moved_mu if hasattr(s, "mu"))
    np.testing.assert_array_equal(moved_adam.mu["moe"]["w1"][1], adam.mu["moe"]["w1"][1][order[1]])
    np.testing.assert_array_equal(moved_adam.count, adam.count)
    np.testing.assert_array_equal(
        moved_params["moe"]["router"][0], params["moe"]["router"][0][:, order[0]]
    )
    for s in range(1, 4):
        batch = PROGRAM.global_batch(cfg, s)
        params, opt_state, metrics = step(params, opt_state, batch)
        moved_params, moved_opt, moved = step(moved_params, moved_opt, batch)
        np.testing.assert_allclose(moved["loss"], metrics["loss"], rtol=1e-6)
        np.testing.assert_allclose(moved["grad_norm"], metrics["grad_norm"], rtol=1e-5)
        # The same choices, counted under the experts' new numbers.
        tokens = np.asarray(metrics["tokens_per_expert"])
        for layer in range(2):
            np.testing.assert_array_equal(
                moved["tokens_per_expert"][layer], tokens[layer][order[layer]]
            )
        assert float(metrics["dropped_fraction"][0]) > 0
        np.testing.assert_array_equal(moved["dropped_fraction"], metrics["dropped_fraction"])


def test_router_skew_makes_tokens_prefer_the_experts_of_their_byte_range():
    high = jnp.full((4, 32), 200, jnp.int32)  # bytes of expert 6's range (of 8)
    counts = {}
    for skew in (0, 1):
        c = config(router_skew=skew, capacity_factor=0)

        @jax.jit
        def routed(key, c=c):
            params = model.init_params(c, key)
            _, stats = model.forward(c, params, high, lambda p, x: model.moe_layer(p, x, c.layer))
            return stats[0]["tokens_per_expert"]

        counts[skew] = np.asarray(routed(jax.random.PRNGKey(0)))
    assert counts[1][6] == 4 * 32  # every token chose it
    assert counts[0][6] < 4 * 32
