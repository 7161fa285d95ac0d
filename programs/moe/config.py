"""The `moe` program's config: the `lm` model's fields plus its experts, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

from programs.base import ConfigError
from programs.lm.config import LMConfig
from programs.moe.layer import MoELayerConfig
from programs.moe.sharded import STRATEGIES

# The `lm` program's small model with 8 experts in every second layer: the `--set`
# overrides of the tests, the demo and the benchmarks.
SMALL_MOE_OVERRIDES = {
    "d_model": "64",
    "n_layers": "2",
    "n_heads": "4",
    "d_ff": "128",
    "d_expert": "128",
    "seq_len": "32",
    "batch_size": "8",
    "warmup_steps": "5",
}


@dataclass(frozen=True)
class MoEConfig(LMConfig):
    """A byte-level decoder LM whose every `moe_every`-th feed-forward block is a
    Mixture-of-Experts layer (`programs.moe.layer`), and how to train it.

    Routing groups are whole sequences by default (`group_size=0`: `seq_len` tokens), so
    that a group never straddles two devices. `capacity_factor=0` is dropless; the default 2.0
    gives top-2 routing as many slots as choices (`ceil(T_g / E) * 2` per expert). The loss is
    the next-byte cross-entropy plus `aux_loss_weight` times the sum of the layers' load
    balancing losses plus `z_loss_weight` times the sum of their router z-losses.

    Where the experts run is the mesh's business: over the job's `expert` mesh axis, and
    over its `fsdp` axis too when `experts_over_fsdp` (so a slice's chips split its share
    of the experts). `dispatch` picks how tokens travel to them ("flat" or "hierarchical",
    see `programs.moe.sharded`); hierarchical needs both an `expert` axis across slices
    and an `fsdp` axis inside them; "packed" is hierarchical with a DCN hop that carries
    only the used slots, so that the bytes between slices follow where tokens route, which
    load-aware placement (`rebalance_every`) improves.
    """

    n_experts: int = 8
    k: int = 2
    d_expert: int = 256
    moe_every: int = 2
    capacity_factor: float = 2.0
    renormalize: bool = True
    group_size: int = 0
    aux_loss_weight: float = 1e-2
    z_loss_weight: float = 1e-3
    dispatch: str = "flat"
    experts_over_fsdp: bool = True
    # Load-aware placement (`controller.placement`): every `rebalance_every` steps (0:
    # never) the controller may re-place the experts over the slices from the routing of
    # the steps since, if that raises the share of choices served on their own slice by at
    # least `rebalance_min_gain`. `dcn_chunk`: rows per trip of dispatch=packed's DCN hop.
    rebalance_every: int = 0
    rebalance_min_gain: float = 0.05
    dcn_chunk: int = 64
    # An instrument for placement experiments, not a training recipe: > 0 initialises the
    # router so that tokens prefer experts by byte value (see `model.init_params`).
    router_skew: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_experts", "d_expert", "moe_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.k not in (1, 2) or self.k > self.n_experts:
            raise ConfigError(f"k={self.k} must be 1 or 2, and at most n_experts={self.n_experts}")
        if self.n_layers % self.moe_every:
            raise ConfigError(
                f"n_layers={self.n_layers} must be a multiple of moe_every={self.moe_every} "
                "(every moe_every-th layer's feed-forward block is an MoE layer)"
            )
        if self.capacity_factor < 0:
            raise ConfigError(
                f"capacity_factor={self.capacity_factor} must be > 0, or 0 for dropless"
            )
        if self.group_size < 0 or (self.batch_size * self.seq_len) % self.tokens_per_group:
            raise ConfigError(
                f"group_size={self.group_size} must divide the {self.batch_size * self.seq_len} "
                "tokens of a step (0: one group per sequence)"
            )
        if self.aux_loss_weight < 0 or self.z_loss_weight < 0:
            raise ConfigError("aux_loss_weight and z_loss_weight must be >= 0")
        if self.rebalance_every < 0 or not 0 <= self.rebalance_min_gain <= 1:
            raise ConfigError(
                f"rebalance_every={self.rebalance_every} must be >= 0 (0: never) and "
                f"rebalance_min_gain={self.rebalance_min_gain} in [0, 1]"
            )
        if self.dcn_chunk < 1 or self.router_skew < 0:
            raise ConfigError(
                f"dcn_chunk={self.dcn_chunk} must be >= 1 and router_skew={self.router_skew} >= 0"
            )
        if self.dispatch not in STRATEGIES:
            raise ConfigError(f"dispatch={self.dispatch!r} must be one of {list(STRATEGIES)}")

    @property
    def tokens_per_group(self) -> int:
        return self.group_size or self.seq_len

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers // self.moe_every

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has an MoE feed-forward block."""
        return (layer + 1) % self.moe_every == 0

    @property
    def layer(self) -> MoELayerConfig:
        """The config every MoE layer routes with."""
        return MoELayerConfig(
            k=self.k,
            capacity_factor=self.capacity_factor or None,
            renormalize=self.renormalize,
            group_size=self.tokens_per_group,
        )
