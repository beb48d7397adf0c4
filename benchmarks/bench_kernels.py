"""Kernel benchmark: each fused kernel against the memory-bandwidth limit of its device.

    python benchmarks/bench_kernels.py [--device cpu|cuda|all] [--sizes-mb ...] [--dtypes float32 float16]
                                       [--repeats 20] [--out DIR]

No MPI. A kernel's effective bandwidth is the bytes it must move (every operand read once,
every output written once) divided by its time; the ratio divides that by the bandwidth
of a plain copy of the same size on the same device, timed alternately in the same run.
1.0 is the memory limit: the kernel costs what moving its bytes costs.

* GPU (CuPy): times from CUDA events around each call; the copy is a device-to-device
  ``cudaMemcpyAsync``. Targets: ratio >= 0.85 for every kernel in float32 and
  float16 at >= 64 MB, and a 1 MB call (host wall time, launch included) <= 1.5x a 1 MB copy.
* CPU (numpy): the copy is ``np.copyto``; target ratio >= 0.9 (one pass over memory).

Every row is the median over repeats, with the quartiles of the per-repeat ratios.
"""

import argparse
import json
import os
import platform
import time

import numpy as np

from mpigossip.core import kernels

# (name, reads, writes, call(x, c, r1, r2, z, send)) in units of the buffer's bytes.
CASES = [
    ("weighted_sum k=1 + debias", 2, 2,
     lambda x, c, r1, r2, z, s: kernels.weighted_sum(x, x, 0.5, [r1], [0.5], z=z, w=0.5)),
    ("weighted_sum k=2", 3, 1, lambda x, c, r1, r2, z, s: kernels.weighted_sum(x, x, 1 / 3, [r1, r2], [1 / 3, 1 / 3])),
    ("split_share", 1, 2, lambda x, c, r1, r2, z, s: kernels.split_share(x, s, 0.5)),
    ("elastic", 2, 2, lambda x, c, r1, r2, z, s: kernels.elastic(x, c, 0.25)),
    ("debias", 1, 1, lambda x, c, r1, r2, z, s: kernels.debias(z, x, 0.5)),
    ("scale", 1, 1, lambda x, c, r1, r2, z, s: kernels.scale(x, 1.0)),
]


def _operands(xp, n, dtype):
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(n).astype(dtype) for _ in range(6)]
    return [xp.asarray(h) for h in host]


class CpuClock:
    xp = np
    name = "cpu"

    def copy(self, dst, src):
        np.copyto(dst, src)

    def time(self, fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def wall(self, fn, calls):
        return self.time(lambda: [fn() for _ in range(calls)]) / calls


class GpuClock:
    name = "cuda"

    def __init__(self):
        import cupy
        self.xp = cupy
        self.cupy = cupy
        self.start, self.end = cupy.cuda.Event(), cupy.cuda.Event()

    def copy(self, dst, src):
        dst.data.copy_from_device_async(src.data, src.nbytes)

    def time(self, fn):
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.cupy.cuda.get_elapsed_time(self.start, self.end) / 1e3

    def wall(self, fn, calls):
        """Host time per call, launches included, for back-to-back calls (small sizes)."""
        self.cupy.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        self.cupy.cuda.get_current_stream().synchronize()
        return (time.perf_counter() - t0) / calls


def measure(clock, mb, dtype, repeats):
    n = int(mb * 2 ** 20) // np.dtype(dtype).itemsize
    x, c, r1, r2, z, s = _operands(clock.xp, n, dtype)
    nbytes = x.nbytes
    copy = lambda: clock.copy(s, x)  # noqa: E731
    rows = []
    for name, reads, writes, call in CASES:
        run = lambda: call(x, c, r1, r2, z, s)  # noqa: E731
        run(), copy()  # warm up (compiles the kernel on first use)
        tk, tc = [], []
        for _ in range(repeats):
            tk.append(clock.time(run))
            tc.append(clock.time(copy))
        tk, tc = np.array(tk), np.array(tc)
        # effective bandwidth of the kernel / bandwidth of the copy (which moves 2 * nbytes)
        ratios = ((reads + writes) * nbytes / tk) / (2 * nbytes / tc)
        q1, med, q3 = np.percentile(ratios, [25, 50, 75])
        row = {"device": clock.name, "kernel": name, "dtype": str(np.dtype(dtype)), "mb": mb,
               "kernel_ms": float(np.median(tk)) * 1e3, "copy_ms": float(np.median(tc)) * 1e3,
               "kernel_gbs": float((reads + writes) * nbytes / np.median(tk) / 1e9),
               "copy_gbs": float(2 * nbytes / np.median(tc) / 1e9),
               "ratio": float(med), "q1": float(q1), "q3": float(q3)}
        if clock.name == "cuda" and mb <= 1:
            calls = 200
            wk, wc = clock.wall(run, calls), clock.wall(copy, calls)
            row.update(call_us=wk * 1e6, copy_call_us=wc * 1e6, call_vs_copy=wk / wc)
        rows.append(row)
    return rows


def table(rows):
    lines = ["| device | kernel | dtype | MB | kernel ms | copy ms | GB/s | ratio to copy | quartiles | 1 MB call vs copy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        call = f"{r['call_vs_copy']:.2f} ({r['call_us']:.1f} vs {r['copy_call_us']:.1f} us)" if "call_vs_copy" in r else ""
        lines.append(f"| {r['device']} | {r['kernel']} | {r['dtype']} | {r['mb']:g} | {r['kernel_ms']:.3f} | "
                     f"{r['copy_ms']:.3f} | {r['kernel_gbs']:.1f} | {r['ratio']:.3f} | {r['q1']:.2f}-{r['q3']:.2f} | "
                     f"{call} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                        help="cpu (numpy), cuda (CuPy), or all that exist here (default)")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=None,
                        help="buffer sizes (default: 1 64 512 on a GPU, 64 on the CPU)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="folder for kernels-<device>.json and .md")
    args = parser.parse_args()
    clocks = []
    if args.device in ("cpu", "all"):
        clocks.append(CpuClock())
    if args.device in ("cuda", "all"):
        try:
            clocks.append(GpuClock())
            clocks[-1].cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no CuPy or no GPU
            if args.device == "cuda":
                raise SystemExit(f"bench_kernels: no CUDA device: {exc}")
            clocks = clocks[:-1] if clocks and clocks[-1].name == "cuda" else clocks
    for clock in clocks:
        sizes = args.sizes_mb or ([1, 64, 512] if clock.name == "cuda" else [64])
        rows = [r for mb in sizes for dtype in args.dtypes for r in measure(clock, mb, dtype, args.repeats)]
        text = table(rows)
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            meta = {"host": platform.node(), "device": clock.name, "repeats": args.repeats}
            if clock.name == "cuda":
                props = clock.cupy.cuda.runtime.getDeviceProperties(0)
                meta["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            with open(os.path.join(args.out, f"kernels-{clock.name}.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=2)
            with open(os.path.join(args.out, f"kernels-{clock.name}.md"), "w") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
