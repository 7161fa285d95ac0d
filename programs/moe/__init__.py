"""Mixture-of-Experts pieces; `layer` holds the MoE layer as a pure JAX function (no program
yet), `sharded` the same layer with its experts split over mesh axes (expert parallelism)."""
