"""What cuBLAS reaches on the routed experts' GEMMs when every expert has the same rows: one
batched bf16 GEMM (torch.bmm) per projection of DeepSeek-V3's experts (hidden 7168, expert
inter 2048; the up projection's gate and up halves as one product 4096 wide), for 128 experts
of 256 rows (an EP 2 rank at 4096 tokens a GPU) and 64 of 512 (one GPU, `--experts 64`), and
the dense 8192³ GEMM `moeflow bench` takes as its ceiling. Each is timed after a second of the
same load (the power cap lowers the clocks), median of 21 runs; random values (zeros run
faster than real data).

    python3 tools/expert_bmm_ceiling.py
"""
import torch

HIDDEN, INTER = 7168, 2048


def sustained(fn, flops):
    """(median ms, TFLOP/s) of `fn` after a second of it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        fn()
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > 1000:
            break
    times = []
    for _ in range(21):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = sorted(times)[len(times) // 2]
    return ms, flops / ms / 1e9


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    for experts, rows in [(128, 256), (64, 512)]:
        total = 0.0
        for name, k, n in [("up", HIDDEN, 2 * INTER), ("down", INTER, HIDDEN)]:
            a = torch.randn(experts, rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
            ms, tflops = sustained(lambda: torch.bmm(a, w.transpose(1, 2)), 2 * experts * rows * k * n)
            total += ms
            print(f"{experts} experts x {rows} rows, {name} ({rows}x{k} by {k}x{n}): {ms:.3f} ms, {tflops:.0f} TFLOP/s")
            del a, w
        print(f"{experts} experts x {rows} rows, both projections: {total:.3f} ms")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms, tflops = sustained(lambda: a @ b, 2 * n**3)
    print(f"dense {n}^3: {ms:.3f} ms, {tflops:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
