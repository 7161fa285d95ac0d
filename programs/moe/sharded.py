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

Three strategies for that exchange, chosen by `ep.strategy`:

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
- "packed": hierarchical, except that the DCN hop carries only the used slots. An expert's
  slots in a group fill as a prefix (`route` claims them in order), so per-group counts say
  which rows of the gathered buffer are used; they travel the ICI step with the buffer and
  cross DCN first in one small exchange. Each device packs the used rows of each slice's
  block to a prefix and sends the prefixes in fixed chunks of `ep.chunk` rows, in a loop
  that runs as many trips as the fullest block to another slice needs (the same count on
  every device). Its own slice's block never travels. The bytes between slices then follow
  routing, the share of choices whose expert is on another slice, rather than capacity:
  placing experts where their tokens are (load-aware placement) cuts them, and so do
  partly used capacity and drops. Unused slots carry zeros and the experts map zero to zero,
  so skipping them changes no result. `stats["dcn_rows"]` reports the loop's reach.

`predict_dcn_traffic` says how many bytes and messages one layer call sends between slices
for a strategy, from the shapes and the mesh alone (for "packed", the most it can send).
"""

from __future__ import annotations

import functools
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

Strategy = Literal["flat", "hierarchical", "packed"]
STRATEGIES: tuple[Strategy, ...] = ("flat", "hierarchical", "packed")
# The strategies that exchange over ICI, then over DCN: expert_axes=(dcn_axis, ici_axis).
_TWO_STEP = ("hierarchical", "packed")


@dataclass(frozen=True)
class ExpertParallelism:
    """Which mesh axes split the experts and the tokens of an MoE layer, and how the
    dispatched tokens travel between them.

    Attributes:
        expert_axes: the axes E is split over, major first. The expert group (the devices
            that together hold all E experts) is their product; tokens are split over them
            too. For "hierarchical" and "packed", exactly two: (the DCN axis, the ICI axis).
        data_axes: further axes the tokens are split over; the experts are replicated over
            them, so each data index has its own expert group and exchanges stay inside it.
        strategy: "flat", "hierarchical" or "packed" (see the module docstring).
        expert_slices: how many slices the expert group spans, for the `local_fraction`
            and `tokens_by_slice` statistics. The slices must be the major part of the
            expert axes (a DCN axis first, or one axis whose DCN part is major, as `MeshSpec`
            lays hybrid axes out), so that slice s holds the s-th block of the group's
            devices and of the experts.
        chunk: rows (slots of D values) per DCN all_to_all of "packed", cut to a whole
            block (I * E_l * G_l * C rows) when longer; other strategies ignore it. Smaller
            chunks follow routing more closely, at more messages.
    """

    expert_axes: tuple[str, ...]
    data_axes: tuple[str, ...] = ()
    strategy: Strategy = "flat"
    expert_slices: int = 1
    chunk: int = 64

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
        if self.strategy in _TWO_STEP and len(self.expert_axes) != 2:
            raise ConfigError(
                f"the {self.strategy} strategy needs expert_axes=(dcn_axis, ici_axis), "
                f"got {self.expert_axes}"
            )
        axes = self.data_axes + self.expert_axes
        if len(set(axes)) != len(axes):
            raise ConfigError(f"an axis appears twice in data_axes + expert_axes: {axes}")
        if isinstance(self.expert_slices, bool) or self.expert_slices < 1:
            raise ConfigError(f"expert_slices={self.expert_slices!r} must be at least 1")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ConfigError(f"chunk={self.chunk!r} must be an int of at least 1")

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


def _exchange(
    buf: jax.Array,
    ep: ExpertParallelism,
    *,
    back: bool = False,
    plan: _PackPlan | None = None,
) -> jax.Array:
    """Sends block j of the leading destination dimension(s) to expert device j, and puts
    what device j sent here in block j: the same shape out, destination index turned into
    source index. Dispatch calls it, and combine calls it again with `back=True` to undo it.

    `buf` is [M, E_l, ...] for "flat" (M = expert group size) and [S, I, E_l, G_l, C, D]
    for the two-step strategies (S, I the sizes of the DCN and ICI axes); "packed" passes
    the `plan` that says which of its rows are used.
    """
    if ep.strategy == "flat":
        return jax.lax.all_to_all(buf, ep.expert_axes, 0, 0, tiled=True)
    dcn, ici = ep.expert_axes

    def over_ici(b: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(b, ici, 1, 1, tiled=True)

    def over_dcn(b: jax.Array) -> jax.Array:
        if plan is None:
            return jax.lax.all_to_all(b, dcn, 0, 0, tiled=True)
        # Coming back, the rows used are the ones that came: send and receive swap.
        send, receive = (plan.received, plan.sent) if back else (plan.sent, plan.received)
        return _packed_over_dcn(b, send, receive, plan, dcn)

    # Each step swaps destination and source along its own dimension, so each undoes
    # itself; going out ICI first gathers a slice's traffic per lane before the DCN hop,
    # coming back DCN first returns it to its slice before ICI scatters it to its chips.
    return over_ici(over_dcn(buf)) if back else over_dcn(over_ici(buf))


class _PackPlan(NamedTuple):
    """Which rows the DCN step of "packed" moves, in both directions. A block is what one
    device exchanges with one slice: R = I * E_l * G_l * C rows of D values."""

    sent: jax.Array  # [S, R] bool: rows used of this device's block for slice s
    received: jax.Array  # [S, R] bool: rows used of the block slice s sends here
    trips: jax.Array  # int32 []: chunks per exchange, the same on every device
    rows: jax.Array  # int32 []: the most used rows of a block to another slice, any device
    chunk: int  # rows per chunk


def _pack_plan(
    counts: jax.Array, capacity: int, blocks: tuple[int, ...], ep: ExpertParallelism
) -> _PackPlan:
    """The plan for this device's kept-choice `counts` [G_l, E] per group and expert.

    `route` claims an expert's slots in order, so slot c is used iff c < count: the counts
    say which rows are used. They take the ICI step like the dispatch buffer (blocked the
    same way), then cross DCN in one dense exchange, so each side knows both directions.
    """
    dcn, ici = ep.expert_axes
    blocked = counts.T.reshape(*blocks, -1, counts.shape[0])  # [S, I, E_l, G_l]
    sent_counts = jax.lax.all_to_all(blocked, ici, 1, 1, tiled=True)
    received_counts = jax.lax.all_to_all(sent_counts, dcn, 0, 0, tiled=True)
    slots = jnp.arange(capacity)

    def used(c: jax.Array) -> jax.Array:
        return (slots < c[..., None]).reshape(blocks[0], -1)

    sent = used(sent_counts)
    # The block for this device's own slice stays here: it sets no trip count.
    own = jnp.arange(blocks[0]) == jax.lax.axis_index(dcn)
    remote = jnp.where(own, 0, jnp.sum(sent, axis=1, dtype=jnp.int32))
    rows = jax.lax.pmax(jnp.max(remote), ep.token_axes)
    # A chunk longer than a block would only carry padding.
    chunk = min(ep.chunk, sent.shape[1])
    return _PackPlan(sent, used(received_counts), (rows + chunk - 1) // chunk, rows, chunk)


def _packed_over_dcn(
    buf: jax.Array, send: jax.Array, receive: jax.Array, plan: _PackPlan, dcn: str
) -> jax.Array:
    """The DCN step of "packed" for `buf` [S, ..., D]: the rows `send` marks of each block
    go to their slice as a prefix; what arrives is put back where `receive` marks, zeros
    elsewhere. This device's own block is taken as it is, without travelling."""
    slices, d_model = buf.shape[0], buf.shape[-1]
    flat = buf.reshape(slices, -1, d_model)
    # A multiple of the chunk, so that no chunk's dynamic_slice is clamped.
    padded = -(-flat.shape[1] // plan.chunk) * plan.chunk
    packed = _pack(flat, send, padded)
    moved = _chunked_all_to_all(packed, plan.trips, plan.chunk, dcn)
    own = (jnp.arange(slices) == jax.lax.axis_index(dcn))[:, None, None]
    return _unpack(jnp.where(own, packed, moved), receive).reshape(buf.shape)


def _pack(rows: jax.Array, used: jax.Array, padded: int) -> jax.Array:
    """[S, padded, D]: the `used` [S, R] rows of `rows` [S, R, D] moved to the front of
    their block, in order; zeros after them."""
    position = jnp.where(used, jnp.cumsum(used, axis=1) - 1, padded)  # unused: dropped

    def one(r: jax.Array, p: jax.Array) -> jax.Array:
        return jnp.zeros((padded, r.shape[-1]), r.dtype).at[p].set(r, mode="drop")

    return jax.vmap(one)(rows, position)


def _unpack(packed: jax.Array, used: jax.Array) -> jax.Array:
    """The inverse of `_pack`: [S, R, D] with each block's prefix put back at its `used`
    rows, zeros at the others."""
    position = jnp.maximum(jnp.cumsum(used, axis=1) - 1, 0)
    rows = jax.vmap(lambda p, i: p[i])(packed, position)
    return jnp.where(used[..., None], rows, jnp.zeros((), packed.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _chunked_all_to_all(packed: jax.Array, trips: jax.Array, chunk: int, axis: str) -> jax.Array:
    """Block j of `packed` [S, padded, D] to device j of `axis`, rows [0, trips * chunk)
    only, `chunk` rows per all_to_all; the rest of each block arrives as zeros.

    A masked block transpose: its transpose is itself, so the backward pass runs the same
    loop on the cotangent (`while_loop` alone is not reverse-differentiable).
    """

    def trip(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        t, out = carry
        start = t * chunk
        piece = jax.lax.dynamic_slice_in_dim(packed, start, chunk, axis=1)
        moved = jax.lax.all_to_all(piece, axis, 0, 0, tiled=True)
        return t + 1, jax.lax.dynamic_update_slice_in_dim(out, moved, start, axis=1)

    _, out = jax.lax.while_loop(
        lambda carry: carry[0] < trips, trip, (jnp.int32(0), jnp.zeros_like(packed))
    )
    return out


def _chunked_fwd(
    packed: jax.Array, trips: jax.Array, chunk: int, axis: str
) -> tuple[jax.Array, jax.Array]:
    return _chunked_all_to_all(packed, trips, chunk, axis), trips


def _chunked_bwd(
    chunk: int, axis: str, trips: jax.Array, cotangent: jax.Array
) -> tuple[jax.Array, None]:
    return _chunked_all_to_all(cotangent, trips, chunk, axis), None


_chunked_all_to_all.defvjp(_chunked_fwd, _chunked_bwd)


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
        token's own slice (1.0 when `ep.expert_slices` is 1); `stats["tokens_by_slice"]`
        [S, E] int32 (S = `ep.expert_slices`): row s counts the served choices of the tokens
        held by slice s's devices, per expert (summed over s: `tokens_per_expert`). With
        "packed", also `stats["dcn_rows"]` int32: the most used rows any device sends one
        other slice in one exchange, which sets the loop's trips (`ceil(rows / chunk)`).

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
        counts = jnp.sum(routing.dispatch, axis=(1, 3), dtype=jnp.int32)  # [G_l, E]
        plan = None
        if ep.strategy == "packed":
            plan = _pack_plan(counts, lay.capacity, expert_blocks, ep)
        # E is laid out major-first over the expert axes, as P(expert_axes) splits w1: the
        # leading blocks index the device that owns each expert.
        blocked = expert_in.reshape(*expert_blocks, lay.experts_per_device, groups, -1, d_model)
        # [..source.., E_l, G_l, C, D]: this device's experts
        arrived = _exchange(blocked, ep, plan=plan)
        hidden = jax.nn.gelu(
            jnp.einsum("...egcd,edh->...egch", arrived, w1.astype(dtype), precision=_HIGHEST),
            approximate=True,
        )
        done = jnp.einsum("...egch,ehd->...egcd", hidden, w2.astype(dtype), precision=_HIGHEST)
        expert_out = _exchange(done, ep, back=True, plan=plan)
        y = jnp.einsum(
            "gtec,egcd->gtd",
            routing.combine.astype(dtype),
            expert_out.reshape(num_experts, groups, -1, d_model),
            precision=_HIGHEST,
        )

        # Stats over all T tokens: sums over this device's tokens, psummed over the token
        # axes, divided by T, as the unsharded layer's means over all tokens.
        axes = ep.token_axes
        first = jax.nn.one_hot(routing.experts[..., 0], num_experts, dtype=jnp.float32)
        f = jax.lax.psum(jnp.sum(first, axis=(0, 1)), axes) / tokens
        p = jax.lax.psum(jnp.sum(routing.probs, axis=(0, 1)), axes) / tokens
        z = jax.lax.psum(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2), axes) / tokens
        here = jnp.sum(counts, axis=0)  # [E]: choices of this device's tokens served
        served = jax.lax.psum(here, axes)
        by_slice = _tokens_by_slice(here, served, lay, ep)
        choices = cfg.k * tokens
        stats = {
            "aux_loss": num_experts * jnp.sum(f * p),
            "z_loss": z,
            "dropped_fraction": (choices - jnp.sum(served)).astype(jnp.float32) / choices,
            "tokens_per_expert": served,
            "local_fraction": _local_fraction(by_slice, served),
            "tokens_by_slice": by_slice,
        }
        if plan is not None:
            stats["dcn_rows"] = plan.rows
        return y.reshape(-1, d_model).astype(x.dtype), stats

    split_tokens = P(ep.token_axes, None)
    split_experts = P(ep.expert_axes, None, None)
    stat_names = [
        "aux_loss",
        "z_loss",
        "dropped_fraction",
        "tokens_per_expert",
        "local_fraction",
        "tokens_by_slice",
    ]
    if ep.strategy == "packed":
        stat_names.append("dcn_rows")
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), split_experts, split_experts, split_tokens),
        out_specs=(split_tokens, dict.fromkeys(stat_names, P())),
    )(router, w1, w2, x)


def _tokens_by_slice(
    here: jax.Array, served: jax.Array, lay: _Layout, ep: ExpertParallelism
) -> jax.Array:
    """[S, E]: the served choices of the tokens each slice holds, per expert, from `here`
    [E], this device's. This device's slice is its block of the expert group (see
    `expert_slices`)."""
    if ep.expert_slices == 1:
        return served[None]
    group = lay.num_experts // lay.experts_per_device  # devices in the expert group
    my_slice = jax.lax.axis_index(ep.expert_axes) // (group // ep.expert_slices)
    mine = (jnp.arange(ep.expert_slices) == my_slice)[:, None]
    return jax.lax.psum(jnp.where(mine, here, 0), ep.token_axes)


def _local_fraction(by_slice: jax.Array, served: jax.Array) -> jax.Array:
    """Of all choices served, the share served by an expert on the slice that holds the
    token: slice s's experts are the s-th block of E."""
    slices, num_experts = by_slice.shape
    if slices == 1:
        return jnp.float32(1.0)
    expert_slice = jnp.arange(num_experts) // (num_experts // slices)
    local = jnp.sum(jnp.where(expert_slice == jnp.arange(slices)[:, None], by_slice, 0))
    return local.astype(jnp.float32) / jnp.maximum(jnp.sum(served), 1).astype(jnp.float32)


@dataclass(frozen=True)
class DcnTraffic:
    """What one forward call of the layer sends between slices, both exchanges together
    (dispatch and combine); a training step's backward pass sends as much again (for
    "packed", less the routing counts, which have no backward).

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
    """DCN traffic of one `sharded_moe_layer` call on `mesh`, from shapes alone; for
    "packed", whose traffic follows routing, the most it can send.

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

    "packed" is hierarchical with the DCN step cut into chunks of c = min(chunk, R) rows,
    R = I * E_l * G_l * C the rows of a block; with every slot used it takes ceil(R / c)
    chunks per direction, each S - 1 messages of c * D elements per device, so at most the
    bytes of hierarchical rounded up to whole chunks, and ceil(R / c) times its messages. A
    call sends `ceil(stats["dcn_rows"] / c)` chunks instead. The routing counts (E * G_l
    int32 per device) add one exchange over each axis, dispatch only.

    Raises:
        ConfigError: as `sharded_moe_layer` would for these sizes.
    """
    axis_sizes = dict(zip(mesh.names, mesh.shape, strict=True))
    lay = _layout(axis_sizes, ep, cfg, tokens, num_experts)
    row = d_model * jnp.dtype(cfg.dtype).itemsize
    buffer = num_experts * lay.groups_per_device * lay.capacity * row
    # (axes of one all_to_all, bytes each device sends in it, how many per call)
    steps: list[tuple[tuple[str, ...], int, int]]
    if ep.strategy == "flat":
        steps = [(ep.expert_axes, buffer, 2)]
    else:
        dcn, ici = ep.expert_axes[:1], ep.expert_axes[1:]
        steps = [(ici, buffer, 2)]
        if ep.strategy == "hierarchical":
            steps.append((dcn, buffer, 2))
        else:
            slices = axis_sizes[dcn[0]]
            rows = buffer // (slices * row)
            chunk = min(ep.chunk, rows)
            counts = num_experts * lay.groups_per_device * 4
            steps += [(ici, counts, 1), (dcn, counts, 1)]
            steps.append((dcn, slices * chunk * row, 2 * -(-rows // chunk)))
    total_bytes = messages = 0
    for axes, sent, times in steps:
        n = math.prod(mesh.axis(a).size for a in axes)
        n_ici = math.prod(mesh.axis(a).ici for a in axes)
        remote = n - n_ici  # peers of one device on other slices
        messages += times * mesh.size * remote
        total_bytes += times * mesh.size * remote * (sent // n)
    return DcnTraffic(bytes=total_bytes, messages=messages)
