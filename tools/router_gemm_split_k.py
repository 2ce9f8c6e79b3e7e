"""DeepSeek-V3's router GEMM (hidden 7168, 256 experts) in f32 without TF32 on one GPU: cuBLAS
(through PyTorch) in one GEMM against the same product split over K into S strided batches
and summed, at several batch sizes. Prints median microseconds of 50 runs and the largest
error of each against an f64 product, relative to the sum of the products' magnitudes.

    python3 tools/router_gemm_split_k.py
"""
import statistics

import torch

torch.backends.cuda.matmul.allow_tf32 = False
H, E = 7168, 256


def median_us(fn, runs=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(E, H, device="cuda", generator=g) / H**0.5
    for t in (128, 512, 2048, 4096, 8192):
        x = torch.randn(t, H, device="cuda", generator=g)
        want = x.double() @ w.double().T
        scale = x.double().abs() @ w.double().abs().T
        out = torch.empty(t, E, device="cuda")
        row = [f"T {t:5d}", f"one GEMM {median_us(lambda: torch.mm(x, w.T, out=out)):7.1f}"]
        err_one = ((out.double() - want).abs() / scale).max().item()
        for s in (2, 4, 8, 16):
            xs = x.view(t, s, H // s).transpose(0, 1)
            ws = w.view(E, s, H // s).transpose(0, 1)
            part = torch.empty(s, t, E, device="cuda")

            def split():
                torch.bmm(xs, ws.transpose(1, 2), out=part)
                torch.sum(part, 0, out=out)

            row.append(f"split {s} {median_us(split):7.1f}")
        err_split = ((out.double() - want).abs() / scale).max().item()
        row.append(f"error {err_one:.1e} / {err_split:.1e}")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
