"""MoE dispatch across slices: flat vs hierarchical all-to-all on the same gang, DCN
messages and bytes per step (predicted and measured, side by side) and tokens/s.
Baseline: flat. Expected: hierarchical sends fewer DCN messages (by the ICI size, 4),
the same all-to-all bytes.

The `moe` program (8 experts in every second of 2 layers, 128 wide, 8 sequences of 128
tokens a step) trains on one gang of 2 x v5litepod-4, held for the whole run, with
`--dcn expert=2`: the mesh (expert=2 over the slices, fsdp=4 inside them), experts split
over both axes. Jobs of each strategy (`dispatch=flat|hierarchical`) alternate on that
gang, flat, hierarchical, flat, ... (3 rounds of 50 steps, 1 of 30 with --quick), so
that the drift of a simulated gang's speed on a shared 2-core machine hits both alike.

Per strategy:

- predicted, whole step: the job's own prediction (`JobInfo.dcn_bytes_predicted` and
  `dcn_messages_predicted`): every collective of the step program as the workers compiled
  it, all-to-alls and gradient all-reduces alike, under controller/dcn.py's cost models.
- predicted, all-to-all part: the same step compiled here, in a helper process with 8 CPU
  devices (`python -m benchmarks.moe_dispatch --compiled-traffic`), exported as the job
  exports it and compiled as a worker compiles it, then `dcn.predict` per collective
  kind. Its total is checked against the job's (`compiled_matches_job`).
- shape model: `programs.moe.sharded.predict_dcn_traffic` (one MoE layer's forward,
  dispatch and combine, from shapes alone) x the MoE layers x 2: the backward of an
  all-to-all is an all-to-all of the same size. `shape_model_matches_compiled` says
  whether it equals the compiled step's all-to-all part. (The compiled step has one
  all-to-all more than the layers' 4 or 8, a 64 KiB resharding the partitioner adds inside
  each slice: it sends nothing between slices.)
- measured: the job's per-step records (`StepMetrics.dcn_bytes`, `dcn_segments`): the
  bytes and TCP data segments the worker processes of one slice sent to those of the
  other, from the kernel's counters (`ss`), averaged over a window of 10 steps. The
  median window is reported, the first and last window of each job left out as edge
  effects (kept in `edge_windows`): the first follows the job's start, the last its end.
  Each window counts the steps the workers completed between two readings (the workers
  run ahead of the steps the controller has recorded; controller/jobs.py `_read_dcn`),
  so a window is exact to about one step.
- tokens/s and step time: the workers' per-step figures, the first 10 steps of each job
  (compilation, warm-up) left out; the median step.

"Messages" are the predictions' unit: one device-to-device transfer of one algorithm step
whose sender and receiver are on different slices (an all-to-all over n devices: each
device sends one to each of its peers on other slices). "Segments" are what the
simulation can count: TCP segments carrying data (`data_segs_out`) on the connections
between the two slices' worker processes. They are not messages: on loopback a segment
holds up to ~64 KiB, so a large message goes as several segments and small ones sent
together may share one; gloo adds its own control traffic (headers, notifications); and
the simulation's 4 devices of a slice live in one process, so its connections carry the
messages of all of them. The measured bytes are TCP payload: everything the workers sent
between the slices, including gloo's headers and the jax.distributed coordination
traffic between the two worker processes; they should exceed the predicted bytes a little.

Result: `hierarchical_fewer_messages`: the predicted all-to-all messages of hierarchical
are fewer than flat's; the ratios hierarchical / flat of messages (predicted), segments
(measured), bytes (both) and tokens/s."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import sim_controller, summarize, write_result
from programs.moe.config import SMALL_MOE_OVERRIDES
from protos import controller_pb2 as pb

SIM = "2xv5litepod-4"
SLICES, SLICE_TYPE = 2, "v5litepod-4"
DCN = {"expert": 2}
STRATEGIES = ("flat", "hierarchical")
# The README's MoE run: 1,024 tokens and ~0.3 s a step here, with every device's
# all-to-all buffer 8 experts x 32 slots x 128 float32 (128 KiB), so that the exchange is
# a visible share of the step's DCN traffic next to the gradient reductions.
CONFIG = SMALL_MOE_OVERRIDES | {
    "d_model": "128",
    "d_ff": "512",
    "d_expert": "256",
    "seq_len": "128",
    "batch_size": "8",
    "total_steps": "200",
}
WARMUP = 10  # steps of each job left out of tokens/s (compilation, warm-up)
ROUNDS, STEPS = 3, 50
QUICK_ROUNDS, QUICK_STEPS = 1, 30  # 3 windows: one between the first and the last
JOB_TIMEOUT_S = 600.0
ENDED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


# -- the prediction of a step compiled here (the helper process) ----------------------------


def compiled_traffic(
    overrides: dict[str, str], mesh: Sequence[Sequence[Any]], gang: Sequence[int]
) -> dict[str, Any]:
    """What the `moe` step with `overrides` sends between slices per strategy, compiled in
    this process as a worker compiles it. Needs a jax with as many CPU devices as the gang
    has chips (XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported):
    run it through `compiled_traffic_in_subprocess`.

    Args:
        overrides: the job's config overrides, without `dispatch`.
        mesh: the job's mesh, (name, dcn, ici) per axis.
        gang: (slices, hosts per slice, chips per host).
    """
    import jax
    from jax import export
    from jax.sharding import Mesh

    from controller import dcn
    from controller.jobs import _export, training_axes
    from programs.base import get_program, make_flat_train_fns
    from programs.moe.model import expert_parallelism
    from programs.moe.sharded import predict_dcn_traffic
    from slicewise.common.mesh import GangShape, MeshAxis, MeshSpec

    spec = MeshSpec(tuple(MeshAxis(str(n), int(d), int(i)) for n, d, i in mesh))
    shape = GangShape(*(int(g) for g in gang))
    grid = spec.device_grid(shape)
    devices = np.array(jax.devices(), dtype=object)[grid]
    concrete = Mesh(devices, spec.names)
    abstract = spec.abstract()
    axes = training_axes(spec)  # as the job runner binds them
    program = get_program("moe")
    slice_of = dcn.slices_of_mesh(spec)
    out = {}
    for strategy in STRATEGIES:
        config = program.make_config(overrides | {"dispatch": strategy})
        exported = export.deserialize(
            bytearray(_export(make_flat_train_fns, program, config, abstract, axes, "cpu").step)
        )
        # As a worker compiles a loaded program (worker/runtime.py `compiled_text`).
        in_shardings = exported.in_shardings_jax(concrete)
        specs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(exported.in_avals, in_shardings, strict=True)
        ]
        tree_args, tree_kwargs = jax.tree.unflatten(exported.in_tree, specs)
        with jax.set_mesh(concrete):
            text = jax.jit(exported.call).trace(*tree_args, **tree_kwargs).lower().compile()
        found = dcn.collectives(str(text.as_text()))
        traffic = dcn.predict(found, slice_of)
        by_kind = {k: {"bytes": b, "messages": m} for k, b, m in traffic.by_kind}
        ep = expert_parallelism(config, axes)
        assert ep is not None
        layer = predict_dcn_traffic(
            spec,
            ep,
            config.layer,
            tokens=config.batch_size * config.seq_len,
            d_model=config.d_model,
            num_experts=config.n_experts,
        )
        out[strategy] = {
            "bytes": traffic.bytes,
            "messages": traffic.messages,
            "by_kind": by_kind,
            "collectives": {
                k: sum(1 for c in found if c.kind == k) for k in dcn.KINDS if k in by_kind
            },
            "in_loop": sum(1 for c in found if c.in_loop),
            # Every collective of the step, with its own share of the prediction.
            "ops": [
                {
                    "name": c.name,
                    "kind": c.kind,
                    "operand_bytes": c.operand_bytes,
                    "group_sizes": sorted({len(g) for g in c.groups}),
                    "groups": len(c.groups),
                    "dcn_bytes": t.bytes,
                    "dcn_messages": t.messages,
                }
                for c in found
                for t in [dcn.predict([c], slice_of)]
            ],
            "shape_model_layer_forward": {"bytes": layer.bytes, "messages": layer.messages},
            "shape_model_step": {
                "bytes": layer.bytes * config.n_moe_layers * 2,
                "messages": layer.messages * config.n_moe_layers * 2,
            },
            "expert_axes": list(ep.expert_axes),
        }
    return out


def compiled_traffic_in_subprocess(
    overrides: dict[str, str], mesh: Sequence[Sequence[Any]], gang: Sequence[int]
) -> dict[str, Any]:
    """`compiled_traffic` in a fresh process with one CPU device per chip of the gang."""
    devices = int(np.prod([int(g) for g in gang]))
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    request = json.dumps({"overrides": overrides, "mesh": list(mesh), "gang": list(gang)})
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.moe_dispatch", "--compiled-traffic"],
        input=request,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"compiling the step here failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the jobs --------------------------------------------------------------------------------


def _run_job(client: Any, gang: Any, strategy: str, steps: int) -> dict[str, Any]:
    """Runs one `moe` job of `steps` steps with `strategy` on `gang`; its figures."""
    job = client.submit_job(
        "moe",
        steps=steps,
        overrides=CONFIG | {"dispatch": strategy},
        dcn=DCN,
        gang=gang,
        checkpoint_every=0,
    )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (info := client.job(job.job_id)).state not in ENDED:
        if time.monotonic() > deadline:
            client.cancel_job(job.job_id)
            raise TimeoutError(f"job {job.job_id} ({strategy}) did not finish")
        time.sleep(0.5)
    records = sorted(client.job_metrics(job.job_id).steps, key=lambda r: r.step)
    if info.state != pb.JOB_STATE_SUCCEEDED or len(records) != steps:
        raise RuntimeError(
            f"job {job.job_id} ({strategy}) ended after {len(records)} steps: {info.error}"
        )
    if not info.dcn_predicted:
        raise RuntimeError(f"job {job.job_id} ({strategy}) has no DCN prediction")
    windows = [r for r in records if r.dcn_window > 0]
    if len(windows) < 3:
        raise RuntimeError(f"job {job.job_id} ({strategy}) measured {len(windows)} DCN windows")
    timed = records[WARMUP:]
    return {
        "job": job.job_id,
        "mesh": [[a.name, a.dcn, a.ici] for a in info.mesh.axes],
        "predicted_bytes": info.dcn_bytes_predicted,
        "predicted_messages": info.dcn_messages_predicted,
        "flops_per_step": info.flops_per_step,
        # The first window follows the job's start, the last its end (see the docstring).
        "windows": [
            {
                "step": r.step,
                "window": r.dcn_window,
                "bytes": r.dcn_bytes,
                "segments": r.dcn_segments,
            }
            for r in windows[1:-1]
        ],
        "edge_windows": [
            {
                "step": r.step,
                "window": r.dcn_window,
                "bytes": r.dcn_bytes,
                "segments": r.dcn_segments,
            }
            for r in (windows[0], windows[-1])
        ],
        "tokens_per_s": float(np.median([r.tokens_per_s for r in timed])),
        "step_time_s": float(np.median([r.step_time_s for r in timed])),
        "local_fraction": float(
            np.mean([e.local_fraction for r in timed for e in r.experts] or [float("nan")])
        ),
        "dropped_fraction": float(
            np.mean([e.dropped_fraction for r in timed for e in r.experts] or [float("nan")])
        ),
        "final_loss": records[-1].loss,
    }


def _strategy_summary(jobs: list[dict[str, Any]], compiled: dict[str, Any]) -> dict[str, Any]:
    windows = [w for j in jobs for w in j["windows"]]
    bytes_measured = summarize([w["bytes"] for w in windows])
    segments_measured = summarize([w["segments"] for w in windows])
    predicted_bytes = {j["predicted_bytes"] for j in jobs}
    predicted_messages = {j["predicted_messages"] for j in jobs}
    a2a = compiled["by_kind"].get("all-to-all", {"bytes": 0, "messages": 0})
    total = {"bytes": float(max(predicted_bytes)), "messages": int(max(predicted_messages))}
    return {
        "predicted": {
            "step": total,
            "all_to_all": a2a,
            "other": {
                "bytes": total["bytes"] - a2a["bytes"],
                "messages": total["messages"] - a2a["messages"],
            },
            "shape_model": compiled["shape_model_step"],
            "shape_model_layer_forward": compiled["shape_model_layer_forward"],
            "compiled_here": {
                "bytes": compiled["bytes"],
                "messages": compiled["messages"],
                "by_kind": compiled["by_kind"],
                "collectives": compiled["collectives"],
                "all_to_all_ops_crossing": sum(
                    1 for op in compiled["ops"] if op["kind"] == "all-to-all" and op["dcn_bytes"]
                ),
                "ops": compiled["ops"],
            },
            # Every job of the strategy predicted the same (the same program).
            "same_in_every_job": len(predicted_bytes) == 1 and len(predicted_messages) == 1,
        },
        "measured": {
            "bytes": bytes_measured,
            "segments": segments_measured,
            "bytes_per_segment": bytes_measured["median"] / segments_measured["median"],
            "bytes_over_predicted": bytes_measured["median"] / total["bytes"],
        },
        "tokens_per_s": statistics.median(j["tokens_per_s"] for j in jobs),
        "step_time_s": statistics.median(j["step_time_s"] for j in jobs),
        "round_tokens_per_s": [j["tokens_per_s"] for j in jobs],
        "compiled_matches_job": (compiled["bytes"], compiled["messages"])
        == (total["bytes"], total["messages"]),
        "shape_model_matches_compiled": (
            compiled["shape_model_step"]["bytes"],
            compiled["shape_model_step"]["messages"],
        )
        == (a2a["bytes"], a2a["messages"]),
        "local_fraction": statistics.mean(j["local_fraction"] for j in jobs),
        "dropped_fraction": statistics.mean(j["dropped_fraction"] for j in jobs),
        "jobs": jobs,
    }


def run(quick: bool = False) -> dict[str, Any]:
    import slicewise

    rounds, steps = (QUICK_ROUNDS, QUICK_STEPS) if quick else (ROUNDS, STEPS)
    jobs: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    started = time.monotonic()
    with (
        sim_controller(SIM) as controller,
        slicewise.connect(controller.address) as client,
        client.allocate(slices=SLICES, slice_type=SLICE_TYPE, timeout=300) as gang,
    ):
        shape = (gang.num_slices, gang.hosts_per_slice, gang.chips_per_host)
        for i in range(rounds):
            for strategy in STRATEGIES:
                job = _run_job(client, gang, strategy, steps)
                jobs[strategy].append(job)
                print(
                    f"   round {i + 1}/{rounds} {strategy}: {job['job']} "
                    f"{job['tokens_per_s']:,.0f} tok/s, "
                    f"{statistics.median(w['bytes'] for w in job['windows']):,.0f} B and "
                    f"{statistics.median(w['segments'] for w in job['windows']):,.0f} "
                    "segments measured per step",
                    flush=True,
                )
    jobs_s = time.monotonic() - started
    # Compiled here once the simulation is gone, on the mesh the jobs ran on.
    mesh = jobs[STRATEGIES[0]][0]["mesh"]
    compiled = compiled_traffic_in_subprocess(CONFIG, mesh, shape)
    per = {s: _strategy_summary(jobs[s], compiled[s]) for s in STRATEGIES}
    flat, hier = per["flat"], per["hierarchical"]

    def ratio(get: Any) -> float:
        return float(get(hier)) / float(get(flat))

    ratios = {
        "predicted_messages_all_to_all": ratio(lambda p: p["predicted"]["all_to_all"]["messages"]),
        "predicted_messages_step": ratio(lambda p: p["predicted"]["step"]["messages"]),
        "predicted_bytes_all_to_all": ratio(lambda p: p["predicted"]["all_to_all"]["bytes"]),
        "predicted_bytes_step": ratio(lambda p: p["predicted"]["step"]["bytes"]),
        "measured_segments": ratio(lambda p: p["measured"]["segments"]["median"]),
        "measured_bytes": ratio(lambda p: p["measured"]["bytes"]["median"]),
        "tokens_per_s": ratio(lambda p: p["tokens_per_s"]),
        # Each round's pair of jobs, run back to back on the same gang.
        "tokens_per_s_rounds": [
            h["tokens_per_s"] / f["tokens_per_s"]
            for f, h in zip(flat["jobs"], hier["jobs"], strict=True)
        ],
    }
    # Both predict the same bytes; what flat sends more, measured, per message more it
    # sends (predicted): the transport's cost of one message here.
    fewer = flat["predicted"]["step"]["messages"] - hier["predicted"]["step"]["messages"]
    per_message = {
        "messages_fewer": fewer,
        "bytes": (flat["measured"]["bytes"]["median"] - hier["measured"]["bytes"]["median"])
        / fewer,
        "segments": (
            flat["measured"]["segments"]["median"] - hier["measured"]["segments"]["median"]
        )
        / fewer,
    }
    return {
        "config": {
            "sim": SIM,
            "slices": SLICES,
            "slice_type": SLICE_TYPE,
            "dcn": DCN,
            "mesh": mesh,
            "overrides": CONFIG,
            "rounds": rounds,
            "steps_per_job": steps,
            "warmup_steps": WARMUP,
            "same_gang": True,
            "order": [s for _ in range(rounds) for s in STRATEGIES],
            "quick": quick,
            "jobs_s": round(jobs_s, 1),
        },
        "strategies": per,
        "ratios": ratios,
        "measured_per_message_fewer": per_message,
        "hierarchical_fewer_messages": (
            hier["predicted"]["all_to_all"]["messages"]
            < flat["predicted"]["all_to_all"]["messages"]
        ),
        "hierarchical_fewer_segments_measured": (
            hier["measured"]["segments"]["median"] < flat["measured"]["segments"]["median"]
        ),
    }


# -- reporting -------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    per = result["strategies"]
    names = list(per)
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    bars = [
        ("predicted, step", "tab:blue", lambda p, u: p["predicted"]["step"][u]),
        ("predicted, all-to-all", "tab:cyan", lambda p, u: p["predicted"]["all_to_all"][u]),
        ("shape model", "tab:purple", lambda p, u: p["predicted"]["shape_model"][u]),
        ("measured (median window)", "tab:orange", None),
    ]
    width = 0.8 / len(bars)
    for ax, unit, measured, scale, label in (
        (axes[0], "bytes", "bytes", 1e-6, "MB per step"),
        (
            axes[1],
            "messages",
            "segments",
            1.0,
            "messages (predicted) / TCP segments (measured) per step",
        ),
    ):
        for i, (name, color, get) in enumerate(bars):
            values = [
                (p["measured"][measured]["median"] if get is None else get(p, unit)) * scale
                for p in per.values()
            ]
            bar_name = name if get is not None or unit == "bytes" else "measured segments"
            offset = (i - (len(bars) - 1) / 2) * width
            drawn = ax.bar(x + offset, values, width, label=bar_name, color=color)
            ax.bar_label(drawn, fmt="%.2f" if unit == "bytes" else "%.0f", fontsize=7)
        ax.set_xticks(x, names)
        ax.set_ylabel(label)
        ax.set_title(f"DCN {unit} per step")
        if unit == "messages":
            # Segments outnumber messages ten to one: a log axis shows both.
            ax.set_yscale("log")
        ax.set_ylim(top=ax.get_ylim()[1] * (10 if unit == "messages" else 1.35))
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax = axes[2]
    drawn = ax.bar(x, [p["tokens_per_s"] for p in per.values()], 0.5, color="tab:green")
    ax.bar_label(drawn, fmt="%.0f")
    for i, p in enumerate(per.values()):
        rounds = p["round_tokens_per_s"]
        ax.plot([i] * len(rounds), rounds, "k.", label="each job" if i == 0 else None)
    ax.set_xticks(x, names)
    ax.set_ylabel("tokens / s (median step)")
    ax.set_title("throughput")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)
    ax.legend(fontsize=8, loc="upper center")
    config = result["config"]
    fig.suptitle(
        f"MoE dispatch across 2 slices, mesh {config['mesh']}, same gang, "
        f"{config['rounds']} alternating round(s) of {config['steps_per_job']} steps"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict[str, Any]) -> str:
    per, r = result["strategies"], result["ratios"]
    lines = [
        f"{'per step':<14}{'pred. step':>22}{'pred. all-to-all':>22}{'shape model':>22}"
        f"{'measured':>26}{'tok/s':>8}{'ms/step':>9}"
    ]
    for name, p in per.items():
        pred, a2a, shape = (
            p["predicted"]["step"],
            p["predicted"]["all_to_all"],
            p["predicted"]["shape_model"],
        )
        m = p["measured"]
        lines.append(
            f"{name:<14}"
            + "".join(
                f"{t['bytes'] / 1e6:>9.3f} MB {t['messages']:>5} msg" for t in (pred, a2a, shape)
            )
            + f"{m['bytes']['median'] / 1e6:>9.3f} MB {m['segments']['median']:>7.0f} segs"
            + f"{p['tokens_per_s']:>8.0f}{1e3 * p['step_time_s']:>9.1f}"
        )
    for name, p in per.items():
        m, here = p["measured"], p["predicted"]["compiled_here"]
        lines.append(
            f"{name}: measured bytes / predicted step bytes {m['bytes_over_predicted']:.3f}; "
            f"{m['bytes_per_segment']:,.0f} B per segment; compiled here = job's prediction: "
            f"{p['compiled_matches_job']}; shape model = compiled all-to-all: "
            f"{p['shape_model_matches_compiled']}; "
            f"all-to-all ops {here['collectives'].get('all-to-all', 0)} "
            f"({here['all_to_all_ops_crossing']} crossing slices); "
            + ", ".join(
                f"{k} {v['bytes'] / 1e6:.3f} MB/{v['messages']} msg"
                for k, v in here["by_kind"].items()
            )
        )
    lines.append(
        f"hierarchical / flat: messages predicted {r['predicted_messages_all_to_all']:.3f} "
        f"(all-to-all), {r['predicted_messages_step']:.3f} (step); segments measured "
        f"{r['measured_segments']:.3f}; bytes predicted {r['predicted_bytes_all_to_all']:.3f} "
        f"(all-to-all), {r['predicted_bytes_step']:.3f} (step), measured {r['measured_bytes']:.3f}; "
        f"tokens/s {r['tokens_per_s']:.3f} (rounds "
        + ", ".join(f"{v:.3f}" for v in r["tokens_per_s_rounds"])
        + ")"
    )
    d = result["measured_per_message_fewer"]
    lines.append(
        f"flat - hierarchical: {d['messages_fewer']} messages predicted, 0 bytes predicted; "
        f"measured {d['bytes'] * d['messages_fewer']:,.0f} B and "
        f"{d['segments'] * d['messages_fewer']:,.0f} segments, i.e. {d['bytes']:,.0f} B and "
        f"{d['segments']:.2f} segments per message"
    )
    lines.append(
        "hierarchical sends fewer DCN messages than flat (predicted, all-to-all): "
        + ("yes" if result["hierarchical_fewer_messages"] else "NO")
        + "; fewer TCP segments measured: "
        + ("yes" if result["hierarchical_fewer_segments_measured"] else "no")
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--compiled-traffic",
        action="store_true",
        help="helper: read {overrides, mesh, gang} as JSON on stdin, print compiled_traffic",
    )
    args = parser.parse_args()
    if args.compiled_traffic:
        request = json.loads(sys.stdin.read())
        print(json.dumps(compiled_traffic(request["overrides"], request["mesh"], request["gang"])))
        return
    result = run(args.quick)
    print(report(result))
    print(write_result("moe_dispatch", result, plot))


if __name__ == "__main__":
    main()
