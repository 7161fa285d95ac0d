"""The `moe` training program: the `lm` program's data, optimizer and schedule, with MoE
feed-forward layers whose experts split over the mesh (`slicewise train moe`)."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import optax

from programs.base import ParallelAxes
from programs.lm.program import LMProgram
from programs.moe import model
from programs.moe.config import MoEConfig


class MoEProgram(LMProgram):
    """Decoder-only MoE LM over bytes; batches are random windows of the corpus.

    Each step reports, per MoE layer, the choices each expert served, the dropped share and
    the share served on the token's own slice (`model.STATS`).
    """

    name: ClassVar[str] = "moe"
    config_type: ClassVar[type] = MoEConfig

    def init_params(self, config: MoEConfig, key: jax.Array) -> Any:  # type: ignore[override]
        return model.init_params(config, key)

    def loss(self, config: MoEConfig, params: Any, batch: dict[str, jax.Array]) -> jax.Array:  # type: ignore[override]
        return self.loss_and_stats(config, params, batch)[0]

    def loss_and_stats(  # type: ignore[override]
        self,
        config: MoEConfig,
        params: Any,
        batch: dict[str, jax.Array],
        mesh: Any = None,
        axes: ParallelAxes | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return model.loss_and_stats(config, params, batch, model.moe_fn_for(config, mesh, axes))

    def param_partition(  # type: ignore[override]
        self, config: MoEConfig, params_shape: Any, axes: ParallelAxes
    ) -> Any:
        del params_shape  # fixed by the config; the caller checks the shapes
        return model.param_partition(config, axes)

    def permute_experts(
        self, config: MoEConfig, params: Any, opt_state: Any, order: jax.Array
    ) -> tuple[Any, Any]:
        """`model.permute_experts` of the params, and of every params-shaped tree in the
        optimizer state (Adam's moments) alike; counters stay. Training continues from the
        result exactly as it would have from the inputs."""
        movers = model.expert_movers(params, order)
        moved = optax.tree_map_params(
            self.optimizer(config),
            lambda leaf, move: move(leaf),
            opt_state,
            movers,
            transform_non_params=lambda leaf: leaf,
        )
        return model.permute_experts(params, order), moved
