"""`slicewise bench [NAME ...]`: run benchmarks side by side with their baselines and
write results/<module>.json and results/<module>.png."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

# name -> module under benchmarks/; each has run(quick) -> dict, plot, report.
BENCHMARKS = {
    "dispatch": "benchmarks.dispatch",
    "transfer": "benchmarks.transfer",
    "putfetch": "benchmarks.putfetch",
    "scheduler": "benchmarks.scheduler",
    "train_overhead": "benchmarks.train_overhead",
    "checkpoint": "benchmarks.checkpoint",
    "recovery": "benchmarks.recovery",
    "moe": "benchmarks.moe_dispatch",
    "load": "benchmarks.load",
    "soak": "benchmarks.soak",
}
# Run only when named: each takes long (soak: about an hour by default).
ON_REQUEST = ("soak",)
DEFAULT = [name for name in BENCHMARKS if name not in ON_REQUEST]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slicewise bench", description=__doc__)
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run (default: all of {', '.join(DEFAULT)}; "
        f"{', '.join(ON_REQUEST)} only when named)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    # Benchmarks with options of their own add them here (they say which benchmark's).
    for name in ON_REQUEST:
        importlib.import_module(BENCHMARKS[name]).add_arguments(parser)
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    from benchmarks.common import write_result

    failed = []
    for name in args.names or DEFAULT:
        module = importlib.import_module(BENCHMARKS[name])
        print(f"== {name}: {(module.__doc__ or name).strip().splitlines()[0]}", flush=True)
        started = time.monotonic()
        try:
            if hasattr(module, "add_arguments"):
                result = module.run(args.quick, args)
            else:
                result = module.run(args.quick)
        except Exception as exc:  # noqa: BLE001 - report, go on with the next benchmark
            print(f"   {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        result["seconds"] = round(time.monotonic() - started, 1)
        # Results are named for the module: `moe` writes results/moe_dispatch.*.
        json_path, png_path = write_result(
            BENCHMARKS[name].rsplit(".", 1)[-1], result, getattr(module, "plot", None)
        )
        print(module.report(result) if hasattr(module, "report") else "", flush=True)
        print(
            f"   wrote {json_path}"
            + (f" and {png_path}" if png_path else "")
            + f" in {result['seconds']} s",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
