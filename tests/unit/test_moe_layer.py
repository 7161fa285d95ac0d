"""`programs.moe.layer` against a plain per-token for-loop reference written here.

The reference decides routing with Python loops over float64 probabilities (top-k by a
strict `>` scan, so ties keep the lower expert; slots claimed group by group, rank by rank,
token by token) and computes outputs and losses token by token in jax.numpy over Python
loops, so that `jax.grad` gives its exact gradients. Routing decisions are piecewise
constant, so the reference takes them as fixed when differentiating, as the layer does.

Tolerances: float32 against float32, rtol 1e-5, plus an atol of 1e-6 times the largest
magnitude in the compared array. The atol is for entries that are small because O(1) terms
cancel in them (some gradient entries): their rounding error is a few ulp of the terms, not
of the entry. Against a float64 reference both float32 sides err by up to ~2e-7 of that
scale; the two disagree by at most 2.5e-7 of it over these cases (measured).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from programs.base import ConfigError, get_program, known_programs
from programs.moe.layer import MoELayerConfig, expert_capacity, init_params, moe_layer, route

D, H = 8, 16
RTOL, ATOL = 1e-5, 1e-6
# These graphs run once each: XLA's backend optimisations would cost more compile time
# (~40% of this file's) than they save.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


@dataclass
class Plan:
    """The reference's routing decisions for T tokens."""

    experts: list[list[int]]  # [T][k] chosen experts, best first
    kept: list[list[bool]]  # [T][k]
    dispatch: np.ndarray  # [G, T_g, E, C] bool
    gates: np.ndarray  # [T, k] float64


def reference_capacity(tokens_per_group: int, num_experts: int, factor: float | None) -> int:
    if factor is None:
        return tokens_per_group
    exact = Fraction(math.ceil(Fraction(tokens_per_group, num_experts))) * Fraction(str(factor))
    return min(tokens_per_group, math.ceil(exact))


def reference_plan(probs: np.ndarray, cfg: MoELayerConfig) -> Plan:
    tokens, num_experts = probs.shape
    group = cfg.group_size or tokens
    capacity = reference_capacity(group, num_experts, cfg.capacity_factor)
    experts, gates = [], np.zeros((tokens, cfg.k))
    for t in range(tokens):
        remaining = list(range(num_experts))
        chosen = []
        for _ in range(cfg.k):
            best = remaining[0]
            for e in remaining:
                if probs[t, e] > probs[t, best]:
                    best = e
            remaining.remove(best)
            chosen.append(best)
        experts.append(chosen)
        gates[t] = [probs[t, e] for e in chosen]
        if cfg.renormalize:
            gates[t] /= gates[t].sum()
    kept = [[False] * cfg.k for _ in range(tokens)]
    dispatch = np.zeros((tokens // group, group, num_experts, capacity), bool)
    for g in range(tokens // group):
        used = [0] * num_experts
        for rank in range(cfg.k):
            for i in range(group):
                t = g * group + i
                e = experts[t][rank]
                if used[e] < capacity:
                    dispatch[g, i, e, used[e]] = True
                    kept[t][rank] = True
                    used[e] += 1
    return Plan(experts, kept, dispatch, gates)


def gelu_tanh(h):
    return 0.5 * h * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))


def reference_forward(params, x, plan: Plan, cfg: MoELayerConfig):
    """y [T, D], aux_loss, z_loss, token by token, with the routing of `plan`."""
    tokens = x.shape[0]
    num_experts = params["router"].shape[1]
    # Rows taken apart once (one op each) rather than indexed one by one: eager JAX compiles
    # an op per distinct static index, which would dominate this test's time.
    xs, w1s, w2s = jnp.unstack(x), jnp.unstack(params["w1"]), jnp.unstack(params["w2"])
    ys, probs, lse_squared = [], [], []
    for t in range(tokens):
        logit = xs[t] @ params["router"]
        top = jnp.max(logit)
        ex = jnp.exp(logit - top)
        p = ex / jnp.sum(ex)
        probs.append(p)
        lse_squared.append((top + jnp.log(jnp.sum(ex))) ** 2)
        p_of = jnp.unstack(p)
        gates = [p_of[e] for e in plan.experts[t]]
        if cfg.renormalize:
            total = sum(gates)
            gates = [g / total for g in gates]
        y = jnp.zeros(x.shape[1])
        for rank, e in enumerate(plan.experts[t]):
            if plan.kept[t][rank]:
                y = y + gates[rank] * (gelu_tanh(xs[t] @ w1s[e]) @ w2s[e])
        ys.append(y)
    first = np.zeros(num_experts)
    for t in range(tokens):
        first[plan.experts[t][0]] += 1 / tokens
    mean_prob = jnp.unstack(sum(probs) / tokens)
    aux = num_experts * sum(first[e] * mean_prob[e] for e in range(num_experts))
    return jnp.stack(ys), aux, sum(lse_squared) / tokens


def make_inputs(seed: int, tokens: int, num_experts: int):
    """Params, tokens x and the output weights r of the test loss sum(y * r), all O(1).

    numpy draws them: jax.random would compile its ops anew for every shape.
    """
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(0.0, scale, shape), jnp.float32)

    # The router is sharper than a usual init, so that routing is skewed and capacity bites.
    params = {
        "router": normal(D, num_experts, scale=3 * D**-0.5),
        "w1": normal(num_experts, D, H, scale=D**-0.5),
        "w2": normal(num_experts, H, D, scale=H**-0.5),
    }
    return params, normal(tokens, D), normal(tokens, D)


def assert_close(actual, expected, what):
    expected = np.asarray(expected)
    atol = ATOL * max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=RTOL, atol=atol, err_msg=what)


# 16 tokens; with k=2 in two groups of 8 and renormalised gates (GShard), with k=1 as one
# group and raw-probability gates (Switch), which lets the expert path's gradient reach the
# router. Capacities run from 1 to 16 slots, with rounded-up products among them
# (8 / 4 * 1.25 = 2.5 -> 3, 16 / 8 * 1.25 = 2.5 -> 3).
TOKENS = 16
CASES = [
    (k, e, cf, 8 if k == 2 else None, k == 2)
    for k in (1, 2)
    for e in (4, 8)
    for cf in (1.0, 1.25, 2.0, None)
] + [(2, 8, 1.25, 8, False), (1, 4, 1.25, 8, True)]


@pytest.mark.parametrize("k,num_experts,capacity_factor,group_size,renormalize", CASES)
def test_layer_equals_the_per_token_reference(
    k, num_experts, capacity_factor, group_size, renormalize
):
    cfg = MoELayerConfig(k, capacity_factor, renormalize, group_size)
    tokens = TOKENS
    params, x, r = make_inputs(seed=k * 100 + num_experts, tokens=tokens, num_experts=num_experts)

    logits64 = np.asarray(x, np.float64) @ np.asarray(params["router"], np.float64)
    probs64 = np.exp(logits64 - logits64.max(-1, keepdims=True))
    probs64 /= probs64.sum(-1, keepdims=True)
    plan = reference_plan(probs64, cfg)

    group = group_size or tokens
    capacity = expert_capacity(cfg, group, num_experts)
    assert capacity == reference_capacity(group, num_experts, capacity_factor)

    def layer_loss(params, x):
        y, stats = moe_layer(params, x, cfg)
        logits = (x @ params["router"]).reshape(tokens // group, group, num_experts)
        routing = route(logits, cfg, capacity)
        return jnp.sum(y * r) + stats["aux_loss"] + stats["z_loss"], (y, stats, routing)

    def reference_loss(params, x):
        y, aux, z = reference_forward(params, x, plan, cfg)
        return jnp.sum(y * r) + aux + z, (y, aux, z)

    (_, (y, stats, routing)), grads = jit(jax.value_and_grad(layer_loss, (0, 1), has_aux=True))(
        params, x
    )
    (_, (ref_y, ref_aux, ref_z)), ref_grads = jax.value_and_grad(
        reference_loss, (0, 1), has_aux=True
    )(params, x)

    assert_close(y, ref_y, "y")
    assert_close(stats["aux_loss"], ref_aux, "aux_loss")
    assert_close(stats["z_loss"], ref_z, "z_loss")
    served = plan.dispatch.sum(axis=(0, 1, 3))
    np.testing.assert_array_equal(np.asarray(stats["tokens_per_expert"]), served)
    dropped = sum(not kept for row in plan.kept for kept in row) / (k * tokens)
    assert float(stats["dropped_fraction"]) == pytest.approx(dropped, abs=1e-7)
    if capacity_factor is None:
        assert dropped == 0
    if capacity_factor == 1.0 and k == 2:
        assert dropped > 0  # 2 * 8 choices per group cannot fit ceil(8 / E) * E = 8 slots
    for name in ("router", "w1", "w2"):
        assert_close(grads[0][name], ref_grads[0][name], f"d/d{name}")
    assert_close(grads[1], ref_grads[1], "d/dx")

    # The masks themselves (the must-show asks for capacity factor 2; every case holds):
    # dispatch bit for bit; combine nonzero exactly where dispatch is, with the gates.
    np.testing.assert_array_equal(np.asarray(routing.dispatch), plan.dispatch)
    combine = np.asarray(routing.combine)
    np.testing.assert_array_equal(combine != 0, plan.dispatch)
    expected = np.zeros_like(plan.dispatch, np.float64)
    for g, i, e, c in zip(*np.nonzero(plan.dispatch), strict=True):
        expected[g, i, e, c] = plan.gates[g * group + i, plan.experts[g * group + i].index(e)]
    assert_close(combine, expected, "combine")


def test_ties_go_to_the_lower_expert_index():
    cfg = MoELayerConfig(k=2, capacity_factor=None)
    logits = jnp.array([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 1.0, 5.0]]])
    routing = jit(route, static_argnums=(1, 2))(logits, cfg, 3)
    assert np.asarray(routing.experts).tolist() == [[[1, 2], [0, 1], [1, 3]]]

    # Through the whole layer: a zero router ties every expert for every token, so all
    # first choices go to expert 0 and all second choices to expert 1, 3 slots each per
    # group of 12 (E=4, capacity factor 1.0).
    params, x, _ = make_inputs(seed=0, tokens=24, num_experts=4)
    params["router"] = jnp.zeros_like(params["router"])
    layer = jit(moe_layer, static_argnums=2)
    _, stats = layer(params, x, MoELayerConfig(k=2, capacity_factor=1.0, group_size=12))
    assert np.asarray(stats["tokens_per_expert"]).tolist() == [6, 6, 0, 0]
    assert float(stats["dropped_fraction"]) == pytest.approx(36 / 48)


def test_every_first_choice_claims_a_slot_before_any_second_choice():
    # One slot per expert. Token 0 prefers experts 0 then 1, token 1 prefers 1 then 2:
    # token 1's first choice takes expert 1's slot although token 0 comes first, so token
    # 0's second choice is the one dropped.
    logits = jnp.array([[[5.0, 4.0, 0.0], [0.0, 5.0, 4.0]]])
    routing = jit(route, static_argnums=(1, 2))(logits, MoELayerConfig(k=2), 1)
    assert np.asarray(routing.kept).tolist() == [[[True, False], [True, True]]]
    assert np.argwhere(np.asarray(routing.dispatch)).tolist() == [
        [0, 0, 0, 0],
        [0, 1, 1, 0],
        [0, 1, 2, 0],
    ]


def test_capacity_rounds_the_product_up_and_never_exceeds_the_group():
    def capacity(tokens_per_group, num_experts, factor):
        return expert_capacity(
            MoELayerConfig(capacity_factor=factor), tokens_per_group, num_experts
        )

    assert capacity(12, 4, 1.25) == 4  # 3 * 1.25 = 3.75
    assert capacity(12, 8, 1.25) == 3  # ceil(12 / 8) = 2, 2 * 1.25 = 2.5
    assert capacity(40, 4, 1.1) == 11  # 10 * 1.1 is 11.000000000000002 in floats
    assert capacity(4, 8, 0.1) == 1
    assert capacity(12, 4, 10.0) == 12
    assert capacity(12, 4, None) == 12


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"k": 3}, "k=3 must be 1 or 2"),
        ({"k": 0}, "k=0"),
        ({"k": True}, "k=True"),
        ({"capacity_factor": 0.0}, "capacity_factor=0.0"),
        ({"capacity_factor": -1.0}, "capacity_factor=-1.0"),
        ({"capacity_factor": float("nan")}, "capacity_factor=nan"),
        ({"capacity_factor": float("inf")}, "capacity_factor=inf"),
        ({"group_size": 0}, "group_size=0"),
        ({"group_size": 1.5}, "group_size=1.5"),
        ({"renormalize": "yes"}, "renormalize='yes'"),
        ({"dtype": "int32"}, "dtype='int32'"),
        ({"dtype": "nope"}, "dtype='nope'"),
    ],
)
def test_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MoELayerConfig(**kwargs)


def test_tokens_must_divide_into_groups_and_params_must_fit():
    params, x, _ = make_inputs(seed=0, tokens=24, num_experts=4)
    with pytest.raises(ConfigError, match="24 tokens do not divide into groups of group_size=5"):
        moe_layer(params, x, MoELayerConfig(group_size=5))
    with pytest.raises(ConfigError, match="do not fit x"):
        moe_layer(params, x[:, :4], MoELayerConfig())


def test_bfloat16_experts_keep_the_dtype_of_x_and_a_float32_router():
    params, x, _ = make_inputs(seed=0, tokens=24, num_experts=4)
    layer = jit(moe_layer, static_argnums=2)
    y32, stats32 = layer(params, x, MoELayerConfig())
    y16, stats16 = layer(params, x, MoELayerConfig(dtype="bfloat16"))
    assert y16.dtype == jnp.float32
    fresh = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), D, 4, H))
    assert {n: (a.shape, a.dtype) for n, a in fresh.items()} == {
        n: (a.shape, a.dtype) for n, a in params.items()
    }
    np.testing.assert_array_equal(stats16["tokens_per_expert"], stats32["tokens_per_expert"])
    np.testing.assert_allclose(y16, y32, rtol=0.05, atol=0.05)


def test_the_moe_program_is_registered_beside_its_layer():
    assert "moe" in known_programs()
    assert get_program("moe").name == "moe"
