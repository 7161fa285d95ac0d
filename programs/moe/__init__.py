"""Mixture-of-Experts pieces; `layer` holds the MoE layer as a pure JAX function (no program yet)."""
