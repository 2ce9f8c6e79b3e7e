"""What cuBLAS reaches on the routed experts' GEMMs when every expert has the same rows: one
batched bf16 GEMM (torch.bmm) per projection of DeepSeek-V3's experts (hidden 7168, expert
inter 2048; the up projection's gate and up halves as one product 4096 wide), for 128 experts
of 256 rows (an EP 2 rank at 4096 tokens a GPU) and 64 of 512 (one GPU, `--experts 64`), and
the dense 8192³ GEMM `moeflow bench` takes as its ceiling. Then, where the installed PyTorch
takes DeepSeek-V3's block scales (1 × 128 for the rows, 128 × 128 for the weights), the same in
fp8 e4m3 with them (cuBLASLt through torch._scaled_mm, one GEMM an expert, replayed from a CUDA
graph so that the host's launches do not set the pace; each GEMM still starts on its own);
PyTorch's fp8 grouped GEMM (torch._scaled_grouped_mm, one launch for all experts, one scale a
row: the kernel of `bench --torch-baseline`'s fp8 layer); and the dense fp8 8192³ GEMM with
block scales and with one scale a tensor (the two rates of `bench --torch-baseline`'s fp8
floor). Each is timed after a second of the same load (the power cap lowers the clocks), median
of 21 runs; random values (zeros run faster than real data).

    python3 tools/expert_bmm_ceiling.py
"""
import torch
from torch_gpu_baseline import block_scaled, dense_fp8_tflops, sustained_ms

HIDDEN, INTER = 7168, 2048


def sustained(fn, flops):
    """(median ms, TFLOP/s) of 21 calls of `fn` after a second of it."""
    ms = sustained_ms(fn, runs=21)
    return ms, flops / ms / 1e9


def fp8(shape):
    return torch.randn(*shape, device="cuda").to(torch.float8_e4m3fn)


def as_graph(calls):
    """A call replaying `calls` (captured once, after a warm-up on a side stream) from a CUDA
    graph: a Python loop of small GEMMs otherwise waits on the host between launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph.replay


def grouped_rowwise(experts, rows, k, n):
    """A call of PyTorch's fp8 grouped GEMM (torch._scaled_grouped_mm) over `experts` experts of
    `rows` rows each: rows [experts · rows, k] by weights [experts, n, k], one scale a row of
    either (all ones), bf16 out."""
    a, w = fp8((experts * rows, k)), fp8((experts, n, k))
    sa, sw = torch.ones(experts * rows, device="cuda"), torch.ones(experts, n, device="cuda")
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows
    return lambda: torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16)


def projections(label, gemm):
    """Times both projections of each shape, `gemm(experts, rows, k, n)` giving the call for
    experts of `rows` rows times weights [experts, n, k], and prints them under `label`."""
    for experts, rows in [(128, 256), (64, 512)]:
        total, what = 0.0, f"{label}{experts} experts x {rows} rows"
        for name, k, n in [("up", HIDDEN, 2 * INTER), ("down", INTER, HIDDEN)]:
            ms, tflops = sustained(gemm(experts, rows, k, n), 2 * experts * rows * k * n)
            total += ms
            print(f"{what}, {name} ({rows}x{k} by {k}x{n}): {ms:.3f} ms, {tflops:.0f} TFLOP/s")
        print(f"{what}, both projections: {total:.3f} ms")


def bmm(experts, rows, k, n):
    """One batched bf16 GEMM over the experts (torch.bmm)."""
    a = torch.randn(experts, rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.bmm(a, w.transpose(1, 2))


def per_expert_block_scaled(experts, rows, k, n):
    """One block-scaled fp8 GEMM an expert (block_scaled), replayed from a CUDA graph."""
    return as_graph([block_scaled(fp8((rows, k)), fp8((n, k))) for _ in range(experts)])


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    projections("", bmm)
    side = 8192
    a = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    ms, tflops = sustained(lambda: a @ b, 2 * side**3)
    print(f"dense {side}^3: {ms:.3f} ms, {tflops:.0f} TFLOP/s")
    del a, b
    try:
        block_scaled(fp8((128, 128)), fp8((128, 128)))()
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"fp8 with block scales: not in this PyTorch ({str(e).splitlines()[0]})")
    else:
        projections("fp8 block scales, ", per_expert_block_scaled)
    try:
        grouped_rowwise(2, 128, 128, 128)()
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"fp8 grouped, one scale a row: not in this PyTorch ({str(e).splitlines()[0]})")
    else:
        projections("fp8 grouped, one scale a row, ", grouped_rowwise)
    for name, block in [("block scales", True), ("one scale a tensor", False)]:
        tflops = dense_fp8_tflops("cuda", side, block, runs=21)
        if tflops is not None:
            print(f"fp8 dense {side}^3, {name}: {2 * side**3 / tflops / 1e9:.3f} ms, {tflops:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
