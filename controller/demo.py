"""`slicewise demo`: start a controller on a simulated cluster, run a sharded program
across two slices from the Python client, then a 2-slice training job that loses a host
mid-way and recovers by itself; show what happened, shut everything down."""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from programs.lm.config import SMALL_OVERRIDES
from protos import controller_pb2 as pb
from slicewise.launch import controller_process


def run_demo(sim: str) -> int:
    import jax

    import slicewise
    from programs.demo import dcn_sum_matmul, dcn_sum_matmul_reference

    say = lambda text: print(f"[demo] {text}", flush=True)  # noqa: E731
    t0 = time.monotonic()
    log_path = Path(tempfile.gettempdir()) / f"slicewise-demo-{os.getpid()}.log"
    say(
        f"starting a controller on a simulated cluster {sim} (one process per TPU host); "
        f"its log: {log_path}"
    )
    # A state directory of its own: the demo starts fresh every time and leaves nothing.
    state = tempfile.TemporaryDirectory(prefix="slicewise-demo-", ignore_cleanup_errors=True)
    with (
        state,
        open(log_path, "w") as log,
        controller_process(
            sim=sim, stderr=log, extra_args=("--state-dir", state.name, "--allow-chaos")
        ) as controller,
    ):
        address = controller.address
        say(f"controller up at {address} after {time.monotonic() - t0:.1f} s")
        with slicewise.connect(address, name="demo") as client:
            info = client.cluster_info()
            say(
                "cluster: "
                + ", ".join(
                    f"{s.name} ({s.chips} chips, {len(s.hosts)} host(s))" for s in info.slices
                )
            )
            num_slices = min(2, len(info.slices))
            slice_kind = info.slices[0].slice_type
            t = time.monotonic()
            with client.allocate(slices=num_slices, slice_type=slice_kind) as gang:
                say(
                    f"allocated {gang} in {time.monotonic() - t:.1f} s "
                    "(workers joined one jax.distributed cluster)"
                )
                model = 2 if gang.chips_per_slice % 2 == 0 else 1
                mesh = gang.mesh(
                    dcn={"slice": gang.num_slices},
                    ici={"data": gang.chips_per_slice // model, "model": model},
                )
                say(f"mesh {mesh}: DCN axis 'slice' across slices, ICI axes inside each")
                rows = 8 * gang.chips_per_slice * gang.num_slices
                rng = np.random.default_rng(0)
                x = rng.standard_normal((rows, 64), dtype=np.float32)
                w = rng.standard_normal((64, 32), dtype=np.float32)
                t = time.monotonic()
                xr = gang.put(x, mesh.sharding(("slice", "data"), None))
                wr = gang.put(w, mesh.sharding(None, "model"))
                step = gang.compile(dcn_sum_matmul(mesh.abstract), xr, wr, name="dcn_sum_matmul")
                say(
                    f"exported {step} on the client with jax.export (jax {jax.__version__}, "
                    f"no devices used) and registered it in {time.monotonic() - t:.2f} s"
                )
                t = time.monotonic()
                outs = [step(xr, wr) for _ in range(20)]
                say(
                    f"queued 20 calls in {1e3 * (time.monotonic() - t):.1f} ms "
                    "(asynchronous dispatch: handles come back at once)"
                )
                t = time.monotonic()
                z = outs[-1].fetch()
                say(f"fetched {outs[-1].spec} after {1e3 * (time.monotonic() - t):.0f} ms")
                want = dcn_sum_matmul_reference(x, w, gang.num_slices)
                err = float(np.max(np.abs(z - want)))
                ok = np.allclose(z, want, rtol=1e-4, atol=1e-4)
                say(
                    f"matmul over ICI + psum over DCN matches numpy: {ok} (max abs error {err:.2e})"
                )
                slicewise.delete(outs + [xr, wr])
            say("gang released")
            if ok and num_slices == 2:
                spare = sum(s.slice_type == slice_kind for s in info.slices) > 2
                ok = _recovery_story(client, slice_kind, spare, say)
        say(
            f"stopping the controller (it stops every worker and simulated host); "
            f"total {time.monotonic() - t0:.1f} s"
        )
    say("done" if ok else "FAILED (see above)")
    return 0 if ok else 1


# A small LM, so that the story takes seconds: 60 steps, a checkpoint every 10.
STORY_CONFIG = SMALL_OVERRIDES | {"total_steps": "60"}
STORY_STEPS, STORY_EVERY = 60, 10


def _recovery_story(client: Any, slice_kind: str, spare: bool, say: Callable[[str], None]) -> bool:
    """Trains on two slices, loses a host mid-way (its raylet and worker killed when a
    spare slice exists to move to, else its worker), and follows the job as it recovers
    by itself; ends with a summary. True when the job succeeded."""
    kind = "remove-host" if spare else "kill-worker"
    at = random.randint(STORY_EVERY * 2 + 3, STORY_EVERY * 3 + 7)
    job = client.submit_job(
        "lm",
        slices=2,
        slice_type=slice_kind,
        steps=STORY_STEPS,
        overrides=STORY_CONFIG,
        checkpoint_every=STORY_EVERY,
    )
    say(
        f"submitted job {job.job_id}: lm on 2 x {slice_kind}, {STORY_STEPS} steps, a "
        f"checkpoint every {STORY_EVERY}"
    )
    say(client.inject_fault(job.job_id, kind, at_step=at) + " (slicewise chaos)")
    loss = float("nan")
    for event in client.watch_job(job.job_id, reconnect_timeout=60):
        for step in event.steps:
            loss = step.loss
            if (step.step + 1) % STORY_EVERY == 0:
                say(f"  step {step.step + 1}/{STORY_STEPS} loss {step.loss:.4f}")
        if event.message and not event.message.startswith("checkpoint step"):
            say(f"  {event.message}")
    done = client.job(job.job_id)
    succeeded = done.state == pb.JOB_STATE_SUCCEEDED
    say(
        f"summary: job {done.job_id} {'succeeded' if succeeded else 'did not succeed'}: "
        f"{done.step}/{done.steps} steps, final loss {loss:.4f}"
    )
    for r in done.recoveries:
        say(f"  what failed: {r.cause}")
        say(
            f"  detected {r.detected_at - r.fault_at:.2f} s after the fault; the first step "
            f"after recovery finished {r.resumed_at - r.fault_at:.1f} s after it"
        )
        if r.source == "peer":
            say(
                f"  resumed at step {r.resumed_from_step} from the surviving slice's replica: "
                "no step lost"
            )
        else:
            say(
                f"  resumed from checkpoint step {r.resumed_from_step}: {r.steps_lost} "
                "step(s) done before the failure ran again"
            )
    if not done.recoveries:
        say("  no recovery recorded: the fault did not reach the job")
    return succeeded and len(done.recoveries) == 1
