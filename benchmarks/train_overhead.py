"""Training overhead of the single controller: the same LM step driven by slicewise's job
runner vs. driven multi-controller style (every worker runs its own loop, builds its own
batch rows, reads its own metrics; no controller), in the same run on the same simulated
cluster, for a step of ~50 ms and of ~5 ms. Ratio = steps/s of the controller-driven job /
steps/s of the multi-controller loop (target >= 0.95 at 50 ms).

The ~50 ms step is data parallel over two simulated slices (the gradient all-reduce
crosses the DCN). A ~5 ms step cannot be made on two simulated hosts here: gloo's
all-reduce between two processes alone takes ~20 ms, so the ~5 ms step runs on one."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import attached_to_ray, sim_controller, write_result

SIM = "3xv5litepod-1"
SLICE_TYPE = "v5litepod-1"
WINDOW = 3
# (slices, LM config) sized for the two step lengths on a 2-core machine.
CONFIGS = {
    "~50 ms": (2, {"d_model": "64", "n_layers": "2", "n_heads": "4", "d_ff": "256",
                   "seq_len": "64", "batch_size": "16"}),
    "~5 ms": (1, {"d_model": "48", "n_layers": "1", "n_heads": "4", "d_ff": "96",
                  "seq_len": "32", "batch_size": "16"}),
}


def _multi_controller(client: Any, slices: int, overrides: dict[str, str], warm: int, n: int
                      ) -> float:
    """Steps per second with each worker of a gang looping on its own."""
    import jax
    import ray

    from controller.client import Mesh
    from controller.jobs import JobSpec, _export
    from controller.mesh import ShardingSpec
    from programs.base import ParallelAxes, get_program, make_flat_train_fns

    gang = client.allocate(slices=slices, slice_type=SLICE_TYPE, timeout=300)
    try:
        spec = JobSpec("lm", slices, SLICE_TYPE, 1, tuple(sorted(overrides.items())))
        from controller.mesh import GangShape

        mesh_spec = spec.mesh_for(GangShape(gang.num_slices, gang.hosts_per_slice,
                                            gang.chips_per_host))
        program = get_program("lm")
        config = program.make_config(overrides)
        abstract = mesh_spec.abstract()
        axes = ParallelAxes.for_mesh(abstract, data=("data",), fsdp="fsdp")
        init_art, step_art, _ = _export(make_flat_train_fns, program, config, abstract, axes,
                                        gang.platform)
        mesh = Mesh(mesh_spec)
        init = gang.load(init_art, mesh, name="lm.init")
        step = gang.load(step_art, mesh, name="lm.step")
        key = gang.put(np.asarray(jax.random.PRNGKey(program.seed(config))),
                       ShardingSpec(mesh_spec, ()))
        state = init(key)
        state = list(state) if isinstance(state, tuple) else [state]
        for a in state:
            a.block_until_ready()
        sharding = ShardingSpec(mesh_spec, (("data", "fsdp"),))
        args = [[a.handle for a in state], "lm", tuple(sorted(overrides.items())), sharding]
        actors = [ray.get_actor(w.actor_name, namespace="slicewise")
                  for w in gang.stats().workers]
        ray.get([a.bench_train_loop.remote(step.id, *args, 0, warm, WINDOW) for a in actors],
                timeout=600)  # compile and warm up
        seconds = ray.get([a.bench_train_loop.remote(step.id, *args, warm, n, WINDOW)
                           for a in actors], timeout=1200)
        return n / max(seconds)
    finally:
        gang.release()


def _controller_driven(client: Any, slices: int, overrides: dict[str, str], warm: int,
                       n: int) -> tuple[float, float]:
    """Steps per second of a job the controller drives (steps after the warm-up), and
    its median step time."""
    job = client.submit_job("lm", slices=slices, slice_type=SLICE_TYPE, steps=warm + n,
                            overrides=overrides)
    deadline = time.monotonic() + 1800
    while client.job(job.job_id).state not in (6, 7, 8):  # succeeded, failed, cancelled
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.job_id} did not finish")
        time.sleep(0.5)
    steps = list(client.job_metrics(job.job_id).steps)
    if len(steps) != warm + n:
        raise RuntimeError(f"job {job.job_id} ended after {len(steps)} steps: "
                           f"{client.job(job.job_id).error}")
    measured = steps[warm:]
    return n / sum(s.step_time_s for s in measured), float(np.median(
        [s.step_time_s for s in measured]))


def run(quick: bool = False) -> dict[str, Any]:
    import slicewise

    warm, n = (5, 30) if quick else (10, 150)
    points = []
    with (sim_controller(SIM) as controller, slicewise.connect(controller.address) as client,
          attached_to_ray(client)):
        for label, (slices, overrides) in CONFIGS.items():
            mc = _multi_controller(client, slices, overrides, warm, n)
            ours, median_step = _controller_driven(client, slices, overrides, warm, n)
            points.append({"step": label, "slices": slices, "overrides": overrides,
                           "multi_controller_steps_per_s": mc,
                           "controller_steps_per_s": ours,
                           "multi_controller_step_ms": 1e3 / mc,
                           "controller_median_step_ms": 1e3 * median_step,
                           "ratio": ours / mc})
    return {"config": {"sim": SIM, "warmup_steps": warm, "steps": n, "window": WINDOW,
                       "mesh": "data over the slices (DCN)", "quick": quick},
            "points": points}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    points = result["points"]
    labels = [p["step"] for p in points]
    x = np.arange(len(points))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(x - 0.2, [p["multi_controller_steps_per_s"] for p in points], 0.4,
           label="multi-controller (each worker loops)", color="tab:gray")
    ax.bar(x + 0.2, [p["controller_steps_per_s"] for p in points], 0.4,
           label="slicewise job (controller drives)", color="tab:blue")
    for i, p in enumerate(points):
        ax.text(i + 0.2, p["controller_steps_per_s"], f"{p['ratio']:.2f}x", ha="center",
                va="bottom")
    ax.set_xticks(x, [f"step {label}\n{p['slices']} slice(s)" for label, p in
                      zip(labels, points, strict=True)])
    ax.set_ylabel("steps / s")
    ax.set_title("LM training step throughput, controller-driven vs multi-controller")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict[str, Any]) -> str:
    return "\n".join(
        f"step {p['step']} ({p['slices']} slice(s)): multi-controller {p['multi_controller_steps_per_s']:.1f} steps/s "
        f"({p['multi_controller_step_ms']:.1f} ms), controller-driven "
        f"{p['controller_steps_per_s']:.1f} steps/s (median {p['controller_median_step_ms']:.1f}"
        f" ms); ratio {p['ratio']:.3f}" for p in result["points"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    print(report(result))
    print(write_result("train_overhead", result, plot))


if __name__ == "__main__":
    main()
