"""Side-by-side measurements against baselines; results as JSON and PNG (see README)."""
