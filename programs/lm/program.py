"""The `lm` training program: a byte-level transformer trained on a file corpus."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from programs.base import ParallelAxes, TrainingProgram, host_rows
from programs.corpus import load_corpus
from programs.lm import model
from programs.lm.config import LMConfig


class LMProgram(TrainingProgram[LMConfig]):
    """Decoder-only LM over bytes; batches are random windows of the corpus."""

    name: ClassVar[str] = "lm"
    config_type: ClassVar[type] = LMConfig

    def init_params(self, config: LMConfig, key: jax.Array) -> Any:
        return model.init_params(config, key)

    def learning_rate(self, config: LMConfig) -> optax.Schedule:
        """Linear warmup to `learning_rate`, cosine decay to `end_learning_rate`."""
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=config.learning_rate,
            warmup_steps=config.warmup_steps,
            decay_steps=config.total_steps,
            end_value=config.end_learning_rate,
        )

    def optimizer(self, config: LMConfig) -> optax.GradientTransformation:
        """Global-norm clipping, then AdamW; norm scales get no weight decay."""

        def decay_mask(params: Any) -> Any:
            return jax.tree.map(lambda p: p.ndim >= 2, params)

        return optax.chain(
            optax.clip_by_global_norm(config.grad_clip),
            optax.adamw(
                self.learning_rate(config),
                b1=config.beta1,
                b2=config.beta2,
                weight_decay=config.weight_decay,
                mask=decay_mask,
            ),
        )

    def loss(self, config: LMConfig, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return model.loss(config, params, batch)

    def batch_spec(self, config: LMConfig) -> dict[str, jax.ShapeDtypeStruct]:
        """`tokens`: int32 [batch_size, seq_len + 1], inputs and shifted targets in one."""
        return {"tokens": jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)}

    def tokens_per_step(self, config: LMConfig) -> int:
        return config.batch_size * config.seq_len

    def host_batch(
        self, config: LMConfig, step: int, host_index: int, num_hosts: int
    ) -> dict[str, np.ndarray]:
        """Rows [lo, hi) of batch `step`: windows at offsets drawn from (seed, step)."""
        lo, hi = host_rows(config.batch_size, host_index, num_hosts)
        corpus = load_corpus(config.corpus)
        length = config.seq_len + 1
        starts = corpus.sequence_starts(
            config.seed, step, config.batch_size, length, per_file=config.per_file_rows
        )
        return {"tokens": corpus.read(starts[lo:hi], length)}

    def data_fingerprint(self, config: LMConfig) -> str:
        """The sha256 of the corpus bytes (loading the corpus if this process has not)."""
        return load_corpus(config.corpus).fingerprint

    def param_partition(self, config: LMConfig, params_shape: Any, axes: ParallelAxes) -> Any:
        return model.param_partition(config, params_shape, axes)
