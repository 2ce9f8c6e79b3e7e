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
floor). The GEMMs also run on uneven experts: 128 or 64 experts over the 32768 slots of 4096
tokens at top-8 routed at random (256 ± 16 or 512 ± 20 rows an expert: an EP 2 rank's and the
one-GPU layer's shapes), where an expert's last tile is partly empty, as in moeflow's grouped
GEMM: bf16 as one cuBLAS GEMM an expert replayed from a CUDA graph, and fp8 as above, also
with each expert's rows rounded up to a multiple of 16, since cuBLASLt's block-scaled GEMM
refuses others. Each is timed after a second of the same load (the power cap lowers the
clocks), median of 21 runs; random values (zeros run faster than real data).

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


def grouped_rowwise(rows, k, n):
    """A call of PyTorch's fp8 grouped GEMM (torch._scaled_grouped_mm) over experts of
    `rows[e]` rows: rows [sum(rows), k] by weights [experts, n, k], one scale a row of either
    (all ones), bf16 out."""
    experts, total = len(rows), sum(rows)
    a, w = fp8((total, k)), fp8((experts, n, k))
    sa, sw = torch.ones(total, device="cuda"), torch.ones(experts, n, device="cuda")
    offs = torch.tensor(rows, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return lambda: torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16)


EVEN = [("128 experts x 256 rows", [256] * 128), ("64 experts x 512 rows", [512] * 64)]


def uneven_rows(multiple=1, experts=64, slots=32768):
    """(label, rows an expert) of `slots` slots routed to `experts` experts at random (seeded),
    each expert's rows rounded up to a multiple of `multiple`."""
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, experts, (slots,), generator=g), minlength=experts).tolist()
    mean = slots / experts
    sd = (sum((c - mean) ** 2 for c in counts) / experts) ** 0.5
    rows = [-(-c // multiple) * multiple for c in counts]
    rounded = f", rounded up to {multiple}s" if multiple > 1 else ""
    return (f"{experts} experts x {mean:.0f} ± {sd:.0f} rows{rounded}", rows)


def projections(label, gemm, shapes):
    """Times both projections of each (name, rows an expert) of `shapes`, `gemm(rows, k, n)`
    giving the call for experts of `rows[e]` rows times weights [experts, n, k], and prints
    them under `label` (or why a shape could not run)."""
    for shape, rows in shapes:
        total, what, m = 0.0, f"{label}{shape}", sum(rows) / len(rows)
        try:
            for name, k, n in [("up", HIDDEN, 2 * INTER), ("down", INTER, HIDDEN)]:
                ms, tflops = sustained(gemm(rows, k, n), 2 * sum(rows) * k * n)
                total += ms
                print(f"{what}, {name} ({m:.0f}x{k} by {k}x{n}): {ms:.3f} ms, {tflops:.0f} TFLOP/s")
        except (RuntimeError, TypeError, ValueError) as e:
            print(f"{what}: not run ({str(e).splitlines()[0]})")
            continue
        print(f"{what}, both projections: {total:.3f} ms")


def bmm(rows, k, n):
    """One batched bf16 GEMM over experts of equal rows (torch.bmm)."""
    a = torch.randn(len(rows), rows[0], k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(rows), n, k, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.bmm(a, w.transpose(1, 2))


def per_expert_bf16(rows, k, n):
    """One bf16 GEMM an expert (cuBLAS), replayed from a CUDA graph: experts of any rows."""
    pairs = [
        (torch.randn(r, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        for r in rows
    ]
    return as_graph([lambda a=a, w=w: a @ w.t() for a, w in pairs])


def per_expert_block_scaled(rows, k, n):
    """One block-scaled fp8 GEMM an expert (block_scaled), replayed from a CUDA graph."""
    return as_graph([block_scaled(fp8((r, k)), fp8((n, k))) for r in rows])


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    projections("", bmm, EVEN)
    projections("bf16, one GEMM an expert, ", per_expert_bf16, [uneven_rows(experts=128), uneven_rows()])
    side = 8192
    a = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    ms, tflops = sustained(lambda: a @ b, 2 * side**3)
    print(f"dense {side}^3: {ms:.3f} ms, {tflops:.0f} TFLOP/s")
    del a, b
    uneven = [uneven_rows(), uneven_rows(multiple=16)]
    try:
        block_scaled(fp8((128, 128)), fp8((128, 128)))()
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"fp8 with block scales: not in this PyTorch ({str(e).splitlines()[0]})")
    else:
        projections("fp8 block scales, ", per_expert_block_scaled, EVEN + uneven)
    try:
        grouped_rowwise([128, 128], 128, 128)()
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"fp8 grouped, one scale a row: not in this PyTorch ({str(e).splitlines()[0]})")
    else:
        projections("fp8 grouped, one scale a row, ", grouped_rowwise, EVEN + uneven)
    for name, block in [("block scales", True), ("one scale a tensor", False)]:
        tflops = dense_fp8_tflops("cuda", side, block, runs=21)
        if tflops is not None:
            print(f"fp8 dense {side}^3, {name}: {2 * side**3 / tflops / 1e9:.3f} ms, {tflops:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
