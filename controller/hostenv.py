"""The process environment a host worker needs, computed by the controller before the
worker starts (JAX reads these once, at initialisation, so they cannot be set later)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

# libtpu's multislice coordinator port (the default that ray.util.tpu uses too).
MEGASCALE_PORT = "8081"


@dataclass(frozen=True)
class HostPlacement:
    """Where one worker sits in its gang."""

    slice_index: int
    host_index: int
    num_slices: int
    hosts_per_slice: int
    chips_per_host: int

    @property
    def process_id(self) -> int:
        return self.slice_index * self.hosts_per_slice + self.host_index


def simulated_host_env(placement: HostPlacement) -> dict[str, str]:
    """CPU XLA with one device per simulated chip, and quiet logs."""
    return {
        "JAX_PLATFORMS": "cpu",
        # Eigen single-threaded within each op: a simulated chip is one device, and the
        # host's devices already run side by side. Eigen's own pool of a thread per core
        # spins while it waits for work, taking cores from the other devices, the other
        # host processes and the controller on the same machine: on the 2-core VM the
        # workers spent 100-140 us more of it per 2-ms call when calls came from the
        # controller than in their own loop; without it, -75 to +8 us, and OpByOp went
        # from 0.87-0.92 to 0.96-0.97 of multi-controller (/tmp harness, four paired
        # runs, 2026-12-04). The baselines' actors get the same flags.
        "XLA_FLAGS": (
            f"--xla_force_host_platform_device_count={placement.chips_per_host} "
            "--xla_cpu_multi_thread_eigen=false"
        ),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        # XLA's in-process threads would otherwise assume every core is theirs.
        "OMP_NUM_THREADS": "1",
        # XLA:CPU allocates a device buffer with malloc, and glibc maps every one of
        # 32 MiB or more afresh (its mmap threshold stops there): each call producing
        # one faulted it in 4-KiB pages. Transparent huge pages for those maps took the
        # 256-MiB slice-to-slice transfer from 0.57 to 0.94 of a raw TCP exchange on the
        # 2-core VM (`slicewise bench transfer`, same hour). glibc >= 2.35; older ones
        # ignore it. Where the device memory pool below is on, jemalloc serves malloc
        # instead and this does nothing.
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        # The simulated devices' threads go first on the cores, the threads feeding them
        # (launching, receiving, reporting) run when a core is free, as on a TPU host
        # where the chips are not the host's cores (worker/sched.py).
        "SLICEWISE_DISPATCH_SCHED": "idle",
    } | device_memory_pool_env()


# Set to 0 in the controller's environment to give simulated hosts the system malloc.
DEVICE_POOL_ENV = "SLICEWISE_SIM_DEVICE_POOL"
# jemalloc's options for a simulated host: every allocation from the ordinary arenas
# (none from the arena for large ones, which returns freed pages at once), and freed
# pages kept for the next allocation, never returned to the kernel, in huge pages.
POOL_MALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1,thp:always"


def jemalloc_library() -> Path | None:
    """The jemalloc that Ray's Linux wheels ship (ray/core/libjemalloc.so), if present."""
    spec = importlib.util.find_spec("ray")
    for root in (spec.submodule_search_locations or []) if spec else []:
        library = Path(root) / "core" / "libjemalloc.so"
        if library.is_file():
            return library
    return None


def device_memory_pool_env() -> dict[str, str]:
    """Simulated device memory that is reused rather than mapped afresh per output.

    A TPU runtime keeps its device memory in a pool of its own; XLA:CPU takes every
    device buffer from malloc, and glibc maps each one of 32 MiB or more afresh and
    unmaps it when freed, so every call producing one had the kernel zero its pages
    again: 30% of the workers' CPU in 256-MiB slice-to-slice swaps went to
    `clear_page_erms` (perf, 2026-12-05). With jemalloc keeping freed pages, a swap
    faults 1-5 pages instead of ~2,000, and the swap went from 0.60-0.63 of a raw TCP
    exchange to 0.87-0.88 (two pairs of alternating runs, 2026-12-06; 0.55-0.59 to
    0.75-0.80 in three against the exchange as measured before that day). The price:
    a simulated host's resident memory stays at its peak until its worker exits, as a
    TPU's memory pool does. Empty (the system malloc) where Ray has no jemalloc, or when
    SLICEWISE_SIM_DEVICE_POOL=0.
    """
    library = jemalloc_library()
    if library is None or os.environ.get(DEVICE_POOL_ENV, "1") == "0":
        return {}
    return {"LD_PRELOAD": str(library), "MALLOC_CONF": POOL_MALLOC_CONF}


def tpu_host_env(placement: HostPlacement, megascale_coordinator: str) -> dict[str, str]:
    """What libtpu needs on a real TPU VM for a multislice job.

    `megascale_coordinator` is the address of host 0 of slice 0. The variable names are
    the ones `ray.util.tpu.get_tpu_coordinator_env_vars` produces.
    """
    env = {
        "JAX_PLATFORMS": "tpu",
        "TPU_WORKER_ID": str(placement.host_index),
    }
    if placement.num_slices > 1:
        env |= {
            "MEGASCALE_COORDINATOR_ADDRESS": megascale_coordinator,
            "MEGASCALE_PORT": MEGASCALE_PORT,
            "MEGASCALE_NUM_SLICES": str(placement.num_slices),
            "MEGASCALE_SLICE_ID": str(placement.slice_index),
        }
    return env
