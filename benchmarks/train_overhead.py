"""Training overhead of the single controller: the same LM step driven by slicewise's job
runner vs. driven multi-controller style (every worker runs its own loop, builds its own
batch rows, reads its own metrics; no controller), for a step of ~50 ms and of ~5 ms.
Ratio = steps/s of the controller-driven job / steps/s of the multi-controller loop
(target >= 0.95 at 50 ms).

Both run on the same gang, the same worker processes and the same compiled step, in
alternating rounds: on a shared 2-core machine the step time of a simulated gang varies
by +-25% from one gang to the next (how its processes and gloo's threads land on the
cores) and drifts over a minute, far more than the overhead being measured. Each round
compares two runs seconds apart on the same processes; the reported ratio is the median
round's (the ratio of the totals is kept too).

The ~50 ms step is data parallel over two simulated slices (the gradient all-reduce
crosses the DCN). A ~5 ms step cannot be made on two simulated hosts here: gloo's
all-reduce between two processes alone takes ~20 ms, so the ~5 ms step runs on one."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import attached_to_ray, run_job, sim_controller, write_result

SIM = "3xv5litepod-1"
SLICE_TYPE = "v5litepod-1"
WINDOW = 3
SETTLE_S = 40.0
# (slices, LM config, measured steps per round) sized for the two step lengths on a
# 2-core machine.
CONFIGS = {
    "~50 ms": (
        2,
        {
            "d_model": "64",
            "n_layers": "2",
            "n_heads": "4",
            "d_ff": "256",
            "seq_len": "64",
            "batch_size": "16",
        },
        100,
    ),
    "~5 ms": (
        1,
        {
            "d_model": "48",
            "n_layers": "1",
            "n_heads": "4",
            "d_ff": "96",
            "seq_len": "32",
            "batch_size": "16",
        },
        400,
    ),
}


class _MultiController:
    """A gang held by the benchmark, with the step loaded and state initialized, whose
    workers each run their own training loop on request (no controller involved)."""

    def __init__(self, client: Any, gang: Any, overrides: dict[str, str]) -> None:
        import jax
        import ray

        from controller.job import JobSpec
        from controller.jobs import _export
        from programs.base import ParallelAxes, get_program, make_flat_train_fns
        from slicewise.client import Mesh
        from slicewise.common.mesh import GangShape, ShardingSpec

        spec = JobSpec("lm", gang.num_slices, SLICE_TYPE, 1, tuple(sorted(overrides.items())))
        mesh_spec = spec.mesh_for(
            GangShape(gang.num_slices, gang.hosts_per_slice, gang.chips_per_host)
        )
        program = get_program("lm")
        config = program.make_config(overrides)
        abstract = mesh_spec.abstract()
        axes = ParallelAxes.for_mesh(abstract, data=("data",), fsdp="fsdp")
        exported = _export(make_flat_train_fns, program, config, abstract, axes, gang.platform)
        init_art, step_art = exported.init, exported.step
        mesh = Mesh(mesh_spec)
        init = gang.load(init_art, mesh, name="lm.init")
        self.step = gang.load(step_art, mesh, name="lm.step")
        key = gang.put(
            np.asarray(jax.random.PRNGKey(program.seed(config))), ShardingSpec(mesh_spec, ())
        )
        state = init(key)
        state = list(state) if isinstance(state, tuple) else [state]
        for a in state:
            a.block_until_ready()
        self.state = state  # kept referenced: the workers' loops read it
        sharding = ShardingSpec(mesh_spec, (("data", "fsdp"),))
        self.args = [[a.handle for a in state], "lm", tuple(sorted(overrides.items())), sharding]
        self.actors = [
            ray.get_actor(w.actor_name, namespace="slicewise") for w in gang.stats().workers
        ]

    def steps_per_s(self, first_step: int, n: int) -> float:
        import ray

        seconds = ray.get(
            [
                a.bench_train_loop.remote(self.step.id, *self.args, first_step, n, WINDOW)
                for a in self.actors
            ],
            timeout=1200,
        )
        return n / max(seconds)


def _controller_driven(
    client: Any, gang: Any, overrides: dict[str, str], warm: int, n: int
) -> tuple[float, float]:
    """Steps per second of a job the controller drives on `gang` (steps after the warm-up),
    and its median step time."""
    # No checkpoints: the multi-controller baseline saves none either.
    steps = run_job(client, warm + n, overrides=overrides, gang=gang, checkpoint_every=0)
    # Steps/s from when the steps finished on the workers (a step's time counts only
    # while the devices ran it: a controller that left them waiting would not show there).
    elapsed = steps[-1].wall_time - steps[warm - 1].wall_time
    return n / elapsed, float(np.median([s.step_time_s for s in steps[warm:]]))


def run(quick: bool = False) -> dict[str, Any]:
    import slicewise

    warm, rounds = (5, 1) if quick else (5, 5)
    points = []
    with (
        sim_controller(SIM) as controller,
        slicewise.connect(controller.address) as client,
        attached_to_ray(client),
    ):
        for label, (slices, overrides, n) in CONFIGS.items():
            n = n // 4 if quick else n
            mc_s, ours_s, medians, ratios = 0.0, 0.0, [], []
            with client.allocate(slices=slices, slice_type=SLICE_TYPE, timeout=300) as gang:
                multi = _MultiController(client, gang, overrides)
                # Compiles, then waits out the stir a new gang causes (Ray starting
                # spare worker processes and the like): step times fall by a third over
                # the first ~30 s of a gang here.
                settled = time.monotonic() + (5 if quick else SETTLE_S)
                while time.monotonic() < settled:
                    multi.steps_per_s(0, 10)
                for _ in range(rounds):
                    mc = multi.steps_per_s(0, n)
                    ours, median_step = _controller_driven(client, gang, overrides, warm, n)
                    mc_s, ours_s = mc_s + n / mc, ours_s + n / ours
                    medians.append(median_step)
                    ratios.append(ours / mc)
            total = n * rounds
            points.append(
                {
                    "step": label,
                    "slices": slices,
                    "overrides": overrides,
                    "rounds": rounds,
                    "steps_per_round": n,
                    "multi_controller_steps_per_s": total / mc_s,
                    "controller_steps_per_s": total / ours_s,
                    "multi_controller_step_ms": 1e3 * mc_s / total,
                    "controller_median_step_ms": 1e3 * float(np.median(medians)),
                    "round_ratios": ratios,
                    "ratio_of_totals": mc_s / ours_s,
                    "ratio": float(np.median(ratios)),
                }
            )
    return {
        "config": {
            "sim": SIM,
            "warmup_steps": warm,
            "rounds": rounds,
            "window": WINDOW,
            "mesh": "data over the slices (DCN)",
            "same_gang": True,
            "settle_s": SETTLE_S,
            "quick": quick,
        },
        "points": points,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    points = result["points"]
    labels = [p["step"] for p in points]
    x = np.arange(len(points))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(
        x - 0.2,
        [p["multi_controller_steps_per_s"] for p in points],
        0.4,
        label="multi-controller (each worker loops)",
        color="tab:gray",
    )
    ax.bar(
        x + 0.2,
        [p["controller_steps_per_s"] for p in points],
        0.4,
        label="slicewise job (controller drives)",
        color="tab:blue",
    )
    for i, p in enumerate(points):
        ax.text(
            i + 0.2, p["controller_steps_per_s"], f"{p['ratio']:.2f}x", ha="center", va="bottom"
        )
    ax.set_xticks(
        x,
        [f"step {label}\n{p['slices']} slice(s)" for label, p in zip(labels, points, strict=True)],
    )
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
        f" ms); ratio {p['ratio']:.3f} (median round; rounds "
        f"{', '.join(f'{r:.3f}' for r in p.get('round_ratios', []))})"
        for p in result["points"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick)
    print(report(result))
    print(write_result("train_overhead", result, plot))


if __name__ == "__main__":
    main()
