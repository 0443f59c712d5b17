"""Host memory that goes back to the system when freed, for runs whose model is larger than memory.

glibc serves an allocation from the process's heap unless it is larger than a threshold that it raises to
the size of the largest block freed so far (up to 32 MiB). Training frees and allocates blocks of megabytes
all the time (torch's gradients, FSDP2's unsharded groups and reduce-scatter outputs, zoe's reads): once the
threshold has risen they come from the heap, and the heap keeps what was freed in its middle. Measured with
``python -m zoe.bench_infinity --params 200M`` on the 2-core development VM (2026-11-28): the resident set
between steps 2.6-2.8 GiB with glibc's default, 1.9 GiB with a fixed threshold of 1 MiB (the same as 128 KiB;
4 MiB: 2.0 GiB). So zoe fixes it at 1 MiB when it is asked to hold a model out of core (parameter offload,
tier nvme), unless the user chose a threshold (``MALLOC_MMAP_THRESHOLD_``). Blocks of 1 MiB and more then
cost a mapping each, which the compute of a step of such a model dwarfs."""
from __future__ import annotations

import os

from . import _zoe

THRESHOLD = 1 << 20
_set = False


def map_large_allocations() -> None:
    """Allocations of THRESHOLD bytes or more mapped on their own from now on, for the whole process."""
    global _set
    if _set or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    _zoe.map_large_allocations(THRESHOLD)
    _set = True
