"""The `lm` program's config: model size, batch and optimizer, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

from programs.base import ConfigError
from programs.corpus import STDLIB

# A small model (64 wide, 2 layers, 8 rows of 32 tokens) that trains at about 0.1 s a step
# on the simulation: the `--set` overrides of the tests, the demo and the benchmarks.
SMALL_OVERRIDES = {
    "d_model": "64",
    "n_layers": "2",
    "n_heads": "4",
    "d_ff": "128",
    "seq_len": "32",
    "batch_size": "8",
    "warmup_steps": "5",
}


@dataclass(frozen=True)
class LMConfig:
    """A byte-level decoder-only transformer and how to train it.

    The defaults train visibly on a CPU in a few minutes. Parallelism is not here: the
    runner chooses the mesh and which of its axes split what.
    """

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    seq_len: int = 128
    batch_size: int = 8
    learning_rate: float = 3e-3
    end_learning_rate: float = 3e-4
    warmup_steps: int = 20
    total_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    corpus: str = STDLIB
    # Each batch gives every corpus file the same block of rows, in file order (see
    # `Corpus.sequence_starts`): per-domain quotas, and per-slice domains when the batch
    # splits over slices.
    per_file_rows: bool = False

    def __post_init__(self) -> None:
        for name in (
            "d_model",
            "n_layers",
            "n_heads",
            "d_ff",
            "seq_len",
            "batch_size",
            "total_steps",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps} must be in [0, total_steps={self.total_steps}]"
            )
        if not 0 <= self.end_learning_rate <= self.learning_rate:
            raise ConfigError(
                f"need 0 <= end_learning_rate ({self.end_learning_rate}) <= learning_rate "
                f"({self.learning_rate})"
            )
        if self.learning_rate <= 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ConfigError("learning_rate and grad_clip must be > 0, weight_decay >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"beta1={self.beta1} and beta2={self.beta2} must be in [0, 1)")
        if self.seed < 0:
            raise ConfigError(f"seed={self.seed} must be >= 0")
        if not self.corpus:
            raise ConfigError("corpus must be 'stdlib' or a file glob")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
