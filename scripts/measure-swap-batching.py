"""Is a batched swap-out/in of many saved tensors worth a C++ op? Times, on a page-cache-backed file:
one os.pwrite per tensor, one os.pwritev over all, torch.cat into one buffer + one pwrite, and the reads
likewise (os.preadv per tensor vs one os.preadv). Medians of 7 after one warm-up call.

What was found, and why fastdist has no C++ op for batched swaps: bench/README.md.

    PYTHONPATH=python python3 scripts/measure-swap-batching.py
"""
import os
import tempfile

import torch

from fastdist.distributed.timing import time_fn


def main():
    fd, name = tempfile.mkstemp(prefix="fastdist-swap-measure-")
    os.unlink(name)
    try:
        for size, count in [(4096, 256), (65536, 64), (1 << 20, 16)]:
            tensors = [torch.randn(size // 4) for _ in range(count)]
            arrays = [t.numpy() for t in tensors]
            total = size * count

            def write_each(arrays=arrays, size=size):
                for i, a in enumerate(arrays):
                    os.pwrite(fd, a, i * size)

            def write_batched(arrays=arrays):
                os.pwritev(fd, arrays, 0)

            def gather_then_write(tensors=tensors, total=total):
                flat = torch.cat(tensors)
                os.pwrite(fd, flat.numpy(), 0)

            def read_each(arrays=arrays, size=size):
                for i, a in enumerate(arrays):
                    os.preadv(fd, [a], i * size)

            def read_batched(arrays=arrays):
                os.preadv(fd, arrays, 0)

            cases = [("pwrite each", write_each), ("pwritev batch", write_batched), ("cat+pwrite", gather_then_write),
                     ("pread each", read_each), ("preadv batch", read_batched)]
            cells = []
            for label, fn in cases:
                t = time_fn(fn, reps=7).median
                cells.append(f"{label} {t * 1e3:.3f} ms ({total / t / 1e9:.2f} GB/s)")
            print(f"{count} x {size} B: " + "  ".join(cells))
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
