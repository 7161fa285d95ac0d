"""Expert parallelism for the MoE layer: `moe_layer` with its experts split over mesh axes.

`sharded_moe_layer(params, x, cfg, mesh, ep)` computes exactly what
`programs.moe.layer.moe_layer(params, x, cfg)` computes, on a mesh (a `jax.sharding.Mesh`, or
the `AbstractMesh` a client exports against):

- the experts (E of `w1` [E, D, H] and `w2` [E, H, D]) are split over `ep.expert_axes`, and
  replicated over every other axis; the router is replicated;
- the tokens (T of `x` [T, D] and of `y`) are split over `ep.data_axes + ep.expert_axes`,
  whole routing groups to a device, so that every group routes on one device exactly as
  the unsharded layer routes it: same top-k, same slots, same drops;
- between routing and the experts, one exchange sends each device's [E, G_l, C, D] dispatch
  buffer to the devices owning the experts, and the same exchange brings the results back.

Two strategies for that exchange, chosen by `ep.strategy`:

- "flat": one `all_to_all` over all the expert axes together. A device exchanges one
  message with every other device of its expert group, in its own slice or not.
- "hierarchical": for experts split over a DCN axis (across slices) times an ICI axis
  (inside a slice), written `expert_axes=(dcn_axis, ici_axis)`. Dispatch is an ICI
  `all_to_all` that gathers, on chip i of each slice, everything its slice sends to chip i
  of any slice; then a DCN `all_to_all` between the chips i of the slices delivers it, one
  message per slice pair and chip lane, each carrying what the ICI step gathered. Combine
  runs the inverse: the DCN exchange brings results back to their source slice, where the
  ICI exchange scatters them to their source chips. The bytes crossing DCN are the same as
  flat; the messages are fewer by the ICI size (see `predict_dcn_traffic`). A third step
  (a scatter over ICI after the DCN step) is not needed: the ICI step already picks the
  lane of the destination chip.

`predict_dcn_traffic` says how many bytes and messages one layer call sends between slices
for a strategy, from the shapes and the mesh alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from programs.base import ConfigError
from programs.moe.layer import MoELayerConfig, Params, check_params, expert_capacity, route
from slicewise.common.mesh import MeshSpec

# As in layer.py: every contraction at full float32 precision, so that routing and the
# one-hot dispatch are exact and the sharded layer agrees with the unsharded one.
_HIGHEST = jax.lax.Precision.HIGHEST

Strategy = Literal["flat", "hierarchical"]
STRATEGIES: tuple[Strategy, ...] = ("flat", "hierarchical")


@dataclass(frozen=True)
class ExpertParallelism:
    """Which mesh axes split the experts and the tokens of an MoE layer, and how the
    dispatched tokens travel between them.

    Attributes:
        expert_axes: the axes E is split over, major first. The expert group (the devices
            that together hold all E experts) is their product; tokens are split over them
            too. For "hierarchical", exactly two: (the DCN axis, the ICI axis).
        data_axes: further axes the tokens are split over; the experts are replicated over
            them, so each data index has its own expert group and exchanges stay inside it.
        strategy: "flat" or "hierarchical" (see the module docstring).
        expert_slices: how many slices the expert group spans, for the `local_fraction`
            statistic. The slices must be the major part of the expert axes (a DCN axis
            first, or one axis whose DCN part is major, as `MeshSpec` lays hybrid axes out),
            so that slice s holds the s-th block of the group's devices and of the experts.
    """

    expert_axes: tuple[str, ...]
    data_axes: tuple[str, ...] = ()
    strategy: Strategy = "flat"
    expert_slices: int = 1

    def __post_init__(self) -> None:
        # Accept a single axis name where a tuple is meant: ("expert") is a common slip.
        for name in ("expert_axes", "data_axes"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r} must be one of {list(STRATEGIES)}")
        if not self.expert_axes:
            raise ConfigError("expert_axes must name at least one mesh axis")
        if self.strategy == "hierarchical" and len(self.expert_axes) != 2:
            raise ConfigError(
                f"the hierarchical strategy needs expert_axes=(dcn_axis, ici_axis), "
                f"got {self.expert_axes}"
            )
        axes = self.data_axes + self.expert_axes
        if len(set(axes)) != len(axes):
            raise ConfigError(f"an axis appears twice in data_axes + expert_axes: {axes}")
        if isinstance(self.expert_slices, bool) or self.expert_slices < 1:
            raise ConfigError(f"expert_slices={self.expert_slices!r} must be at least 1")

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes the tokens are split over, major first."""
        return self.data_axes + self.expert_axes


class _Layout(NamedTuple):
    """Sizes of one sharded layer call, checked against the mesh."""

    tokens: int  # T, all devices together
    group: int  # T_g
    groups_per_device: int  # G_l
    num_experts: int  # E
    experts_per_device: int  # E_l
    capacity: int  # C


def _layout(
    axis_sizes: dict[str, int],
    ep: ExpertParallelism,
    cfg: MoELayerConfig,
    tokens: int,
    num_experts: int,
) -> _Layout:
    missing = [a for a in ep.token_axes if a not in axis_sizes]
    if missing:
        raise ConfigError(f"mesh has no axis {missing}; its axes are {list(axis_sizes)}")
    expert_devices = math.prod(axis_sizes[a] for a in ep.expert_axes)
    token_devices = math.prod(axis_sizes[a] for a in ep.token_axes)
    if num_experts % expert_devices:
        raise ConfigError(
            f"{num_experts} experts do not split evenly over the {expert_devices} devices of "
            f"expert axes {ep.expert_axes}"
        )
    if expert_devices % ep.expert_slices:
        raise ConfigError(
            f"the {expert_devices} devices of expert axes {ep.expert_axes} do not split over "
            f"expert_slices={ep.expert_slices} slices"
        )
    # Routing is per group, so a device may route its tokens alone only if it holds whole
    # groups; one group of all tokens (group_size=None) could only route on one device.
    group = cfg.group_size or tokens
    if tokens % (group * token_devices):
        raise ConfigError(
            f"{tokens} tokens in groups of {group} do not split into whole groups over the "
            f"{token_devices} devices of axes {ep.token_axes}; set group_size so that the "
            f"group count is a multiple of {token_devices}"
        )
    return _Layout(
        tokens=tokens,
        group=group,
        groups_per_device=tokens // (group * token_devices),
        num_experts=num_experts,
        experts_per_device=num_experts // expert_devices,
        capacity=expert_capacity(cfg, group, num_experts),
    )


def _exchange(buf: jax.Array, ep: ExpertParallelism, *, back: bool = False) -> jax.Array:
    """Sends block j of the leading destination dimension(s) to expert device j, and puts
    what device j sent here in block j: the same shape out, destination index turned into
    source index. Dispatch calls it, and combine calls it again with `back=True` to undo it.

    `buf` is [M, E_l, ...] for "flat" (M = expert group size) and [S, I, E_l, ...] for
    "hierarchical" (S, I the sizes of its DCN and ICI axes).
    """
    if ep.strategy == "flat":
        return jax.lax.all_to_all(buf, ep.expert_axes, 0, 0, tiled=True)
    dcn, ici = ep.expert_axes

    def over_ici(b: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(b, ici, 1, 1, tiled=True)

    def over_dcn(b: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(b, dcn, 0, 0, tiled=True)

    # Each step swaps destination and source along its own dimension, so each undoes
    # itself; going out ICI first gathers a slice's traffic per lane before the DCN hop,
    # coming back DCN first returns it to its slice before ICI scatters it to its chips.
    return over_ici(over_dcn(buf)) if back else over_dcn(over_ici(buf))


def sharded_moe_layer(
    params: Params,
    x: jax.Array,
    cfg: MoELayerConfig,
    mesh: Any,
    ep: ExpertParallelism,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`moe_layer(params, x, cfg)` with the experts split over `ep.expert_axes` of `mesh`.

    Call it inside `jax.jit`; `mesh` is a `jax.sharding.Mesh` or an `AbstractMesh`. Inputs
    are resharded to `params["w1"|"w2"]: P(expert_axes)`, router replicated,
    `x: P(data_axes + expert_axes)`; `y` comes back split like `x`, the stats replicated.

    Returns:
        `(y, stats)` as `moe_layer` returns them, up to float rounding of the sums, and
        `stats["local_fraction"]`: the share of served choices whose expert is on the
        token's own slice (1.0 when `ep.expert_slices` is 1).

    Raises:
        ConfigError: the params and `x` disagree on sizes, an axis is not in the mesh, E is
            not a multiple of the expert group size, or the routing groups do not split
            evenly over the token axes (with `group_size=None` that means any token split).
    """
    tokens, num_experts = check_params(params, x)
    router, w1, w2 = params["router"], params["w1"], params["w2"]
    d_model = x.shape[1]
    axis_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    lay = _layout(axis_sizes, ep, cfg, tokens, num_experts)
    if ep.strategy == "flat":
        expert_blocks: tuple[int, ...] = (math.prod(axis_sizes[a] for a in ep.expert_axes),)
    else:
        expert_blocks = tuple(axis_sizes[a] for a in ep.expert_axes)
    dtype = jnp.dtype(cfg.dtype)

    def local(
        router: jax.Array, w1: jax.Array, w2: jax.Array, x: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        groups = lay.groups_per_device
        logits = jnp.einsum(
            "td,de->te", x.astype(jnp.float32), router.astype(jnp.float32), precision=_HIGHEST
        )
        routing = route(logits.reshape(groups, lay.group, num_experts), cfg, lay.capacity)
        expert_in = jnp.einsum(
            "gtec,gtd->egcd",
            routing.dispatch.astype(dtype),
            x.reshape(groups, lay.group, d_model).astype(dtype),
            precision=_HIGHEST,
        )
        # E is laid out major-first over the expert axes, as P(expert_axes) splits w1: the
        # leading blocks index the device that owns each expert.
        blocked = expert_in.reshape(*expert_blocks, lay.experts_per_device, groups, -1, d_model)
        arrived = _exchange(blocked, ep)  # [..source.., E_l, G_l, C, D]: this device's experts
        hidden = jax.nn.gelu(
            jnp.einsum("...egcd,edh->...egch", arrived, w1.astype(dtype), precision=_HIGHEST),
            approximate=True,
        )
        done = jnp.einsum("...egch,ehd->...egcd", hidden, w2.astype(dtype), precision=_HIGHEST)
        expert_out = _exchange(done, ep, back=True).reshape(num_experts, groups, -1, d_model)
        y = jnp.einsum(
            "gtec,egcd->gtd", routing.combine.astype(dtype), expert_out, precision=_HIGHEST
        )

        # Stats over all T tokens: sums over this device's tokens, psummed over the token
        # axes, divided by T, as the unsharded layer's means over all tokens.
        axes = ep.token_axes
        first = jax.nn.one_hot(routing.experts[..., 0], num_experts, dtype=jnp.float32)
        f = jax.lax.psum(jnp.sum(first, axis=(0, 1)), axes) / tokens
        p = jax.lax.psum(jnp.sum(routing.probs, axis=(0, 1)), axes) / tokens
        z = jax.lax.psum(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2), axes) / tokens
        served = jax.lax.psum(jnp.sum(routing.dispatch, axis=(0, 1, 3), dtype=jnp.int32), axes)
        choices = cfg.k * tokens
        stats = {
            "aux_loss": num_experts * jnp.sum(f * p),
            "z_loss": z,
            "dropped_fraction": (choices - jnp.sum(served)).astype(jnp.float32) / choices,
            "tokens_per_expert": served,
            "local_fraction": _local_fraction(routing.dispatch, served, lay, ep),
        }
        return y.reshape(-1, d_model).astype(x.dtype), stats

    split_tokens = P(ep.token_axes, None)
    split_experts = P(ep.expert_axes, None, None)
    stat_specs = dict.fromkeys(
        ("aux_loss", "z_loss", "dropped_fraction", "tokens_per_expert", "local_fraction"), P()
    )
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), split_experts, split_experts, split_tokens),
        out_specs=(split_tokens, stat_specs),
    )(router, w1, w2, x)


def _local_fraction(
    dispatch: jax.Array, served: jax.Array, lay: _Layout, ep: ExpertParallelism
) -> jax.Array:
    """Of all choices served (over every device), the share served by an expert on the
    slice that holds the token: this device's slice is its block of the expert group, and
    expert e's slice is the block of the devices that own it (see `expert_slices`)."""
    if ep.expert_slices == 1:
        return jnp.float32(1.0)
    here = jnp.sum(dispatch, axis=(0, 1, 3), dtype=jnp.int32)  # [E], this device's tokens
    group = lay.num_experts // lay.experts_per_device  # devices in the expert group
    my_slice = jax.lax.axis_index(ep.expert_axes) // (group // ep.expert_slices)
    expert_slice = jnp.arange(lay.num_experts) // (lay.num_experts // ep.expert_slices)
    local = jax.lax.psum(jnp.sum(jnp.where(expert_slice == my_slice, here, 0)), ep.token_axes)
    return local.astype(jnp.float32) / jnp.maximum(jnp.sum(served), 1).astype(jnp.float32)


@dataclass(frozen=True)
class DcnTraffic:
    """What one forward call of the layer sends between slices, both exchanges together
    (dispatch and combine); a training step's backward pass sends as much again.

    Attributes:
        bytes: payload bytes that leave one slice for another, summed over all devices.
        messages: device-to-device messages between slices (one per sender, receiver and
            all_to_all step); a device's message to itself or to its own slice is not counted.
    """

    bytes: int
    messages: int


def predict_dcn_traffic(
    mesh: MeshSpec,
    ep: ExpertParallelism,
    cfg: MoELayerConfig,
    *,
    tokens: int,
    d_model: int,
    num_experts: int,
) -> DcnTraffic:
    """DCN traffic of one `sharded_moe_layer` call on `mesh`, from shapes alone.

    The model: every device holds a dispatch buffer of E * G_l * C * D elements of
    `cfg.dtype` (all routing slots, used or not: capacity padding travels too). An
    all_to_all over axes of total size n cuts it into n equal blocks and sends block j to
    the j-th device of its group. A peer is on another slice unless it shares the DCN
    coordinates of those axes; of its n - 1 peers, n - n_ici are, with n_ici the product of
    the axes' ICI parts. Flat runs one all_to_all over all expert axes; hierarchical one
    over the ICI axis (n = I: no DCN traffic when it is a pure ICI axis) and one over the
    DCN axis (n = S: S - 1 messages, each I times a flat block). Each direction (dispatch,
    combine) costs the same. Total bytes are the same for both strategies,
    (S - 1) / S of all dispatch buffers per direction; messages differ by the factor I.

    Raises:
        ConfigError: as `sharded_moe_layer` would for these sizes.
    """
    axis_sizes = dict(zip(mesh.names, mesh.shape, strict=True))
    lay = _layout(axis_sizes, ep, cfg, tokens, num_experts)
    buffer = (
        num_experts * lay.groups_per_device * lay.capacity * d_model * jnp.dtype(cfg.dtype).itemsize
    )
    steps = [ep.expert_axes] if ep.strategy == "flat" else [(a,) for a in reversed(ep.expert_axes)]
    total_bytes = messages = 0
    for axes in steps:
        n = math.prod(mesh.axis(a).size for a in axes)
        n_ici = math.prod(mesh.axis(a).ici for a in axes)
        remote = n - n_ici  # peers of one device on other slices
        messages += mesh.size * remote
        total_bytes += mesh.size * remote * (buffer // n)
    return DcnTraffic(bytes=2 * total_bytes, messages=2 * messages)
