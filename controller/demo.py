"""`slicewise demo`: start a controller on a simulated cluster, run a sharded program
across two slices from the Python client, show what happened, shut everything down."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

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
            sim=sim, stderr=log, extra_args=("--state-dir", state.name)
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
            num_slices = len(info.slices)
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
        say(
            f"stopping the controller (it stops every worker and simulated host); "
            f"total {time.monotonic() - t0:.1f} s"
        )
    say("done" if ok else "FAILED: result differs from numpy")
    return 0 if ok else 1
