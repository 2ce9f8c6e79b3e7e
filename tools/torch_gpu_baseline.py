"""PyTorch baseline of one MoE layer on one GPU, for `moeflow bench --backend cuda --torch-baseline`.

The layer as a PyTorch user writes it today: sigmoid router scores, top-k, renormalised and
scaled (DeepSeek-V3 without the group limit), rows sorted by expert with `argsort`, both expert
matmuls as `torch._grouped_mm` over bf16 weights with SiLU-and-mul between them, outputs put
back in slot order and summed weighted; a shared expert on every token when `--shared-inter` is
not 0. With `--fp8` the experts are fp8 e4m3 with one scale per output row and the rows are
quantized to fp8 with one scale per row before each expert matmul (the tokens once, before the
routed up projection gathers them and the shared expert reads them), the routed ones' matmuls
`torch._scaled_grouped_mm` (PyTorch's fp8 grouped GEMM; its scales are per row, not DeepSeek's
blocks of 128), the shared expert's `torch._scaled_mm`; where the installed PyTorch lacks it or
refuses the shapes, the bf16 layer runs instead and `experts` in the output says so;
`fp8_tflops` is then the rate of a dense 8192³ fp8 matmul (`torch._scaled_mm`, cuBLASLt) after
a second of load, and `fp8_block_tflops` the same with DeepSeek-V3's block scales where the
installed PyTorch takes them. Prints one JSON line: per token count the median CUDA-event time
over `--runs` forwards after three warm-ups.
"""

import argparse
import json

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--shared-inter", type=int, default=0)
    ap.add_argument("--tokens", default="1,32,128,512,4096,16384")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--fp8", action="store_true", help="fp8 experts and rows through torch._scaled_grouped_mm")
    args = ap.parse_args()
    H, I, E, k = args.hidden, args.inter, args.experts, args.top_k
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1234)

    def rand(*shape, scale):
        return ((torch.rand(*shape, generator=g, device=dev) * 2 - 1) * scale).to(torch.bfloat16)

    gate = rand(E, H, scale=3 / H**0.5).float()
    w13 = rand(E, 2 * I, H, scale=2 / H**0.5)
    w2 = rand(E, H, I, scale=2 / I**0.5)
    Is = args.shared_inter
    sw13 = rand(2 * Is, H, scale=2 / H**0.5) if Is else None
    sw2 = rand(H, Is, scale=2 / Is**0.5) if Is else None

    f8 = torch.float8_e4m3fn

    def rowwise(w):
        """w [..., n, k] -> fp8 codes and f32 scales [..., n] (one per row of k values)."""
        wf = w.float()
        scale = wf.abs().amax(-1).clamp(min=1e-12) / 448.0
        return (wf / scale.unsqueeze(-1)).to(f8), scale

    # The fp8 copies of the expert weights only where the fp8 layer runs.
    if args.fp8:
        w13_8, w13_s = rowwise(w13)
        w2_8, w2_s = rowwise(w2)
        if Is:
            sw13_8, sw13_s = rowwise(sw13)
            sw2_8, sw2_s = rowwise(sw2)

    def fp8_mm(a, w8, ws, offs):
        """The grouped product of fp8 rows `a` (codes and scales, from rowwise)."""
        a8, a_s = a
        return torch._scaled_grouped_mm(a8, w8.transpose(-2, -1), a_s, ws, offs=offs, out_dtype=torch.bfloat16)

    def fp8_dense(a, w8, ws):
        """The dense product of fp8 rows `a` (codes and scales, from rowwise)."""
        a8, a_s = a
        return torch._scaled_mm(a8, w8.T, a_s.unsqueeze(-1), ws.unsqueeze(0), out_dtype=torch.bfloat16)

    def bf16_mm(a, w, offs):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

    def layer(x, fp8):
        T = x.shape[0]
        scores = (x.float() @ gate.T).sigmoid()
        w, ids = scores.topk(k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * 2.5
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        src = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).int()
        if fp8:
            # Each token quantized once, its codes and scale then gathered: the same values as
            # quantizing the gathered rows, at a k-th of the work.
            x8, xs = rowwise(x)
            h = fp8_mm((x8[src], xs[src]), w13_8, w13_s, offs)
        else:
            h = bf16_mm(x[src], w13, offs)
        gt, up = h.chunk(2, dim=-1)
        a = F.silu(gt) * up
        y = fp8_mm(rowwise(a), w2_8, w2_s, offs) if fp8 else bf16_mm(a, w2, offs)
        res = torch.empty_like(y)
        res[order] = y
        out = (res.view(T, k, H).float() * w.unsqueeze(-1)).sum(1)
        if sw13 is not None:
            sh = fp8_dense((x8, xs), sw13_8, sw13_s) if fp8 else x @ sw13.T
            a, b = sh.chunk(2, dim=-1)
            a = F.silu(a) * b
            out += (fp8_dense(rowwise(a), sw2_8, sw2_s) if fp8 else a @ sw2.T).float()
        return out

    fp8 = args.fp8 and hasattr(torch, "_scaled_grouped_mm")
    experts = "torch._scaled_grouped_mm, fp8 rowwise" if fp8 else "torch._grouped_mm, bf16"
    if args.fp8 and not fp8:
        experts += " (this PyTorch has no torch._scaled_grouped_mm)"
    records = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = rand(T, H, scale=1.0)
        if fp8:
            try:
                layer(x, True)
            except RuntimeError as e:
                fp8 = False
                experts = f"torch._grouped_mm, bf16 (torch._scaled_grouped_mm refused: {str(e).splitlines()[0][:120]})"
        for _ in range(3):
            layer(x, fp8)
        times = []
        for _ in range(args.runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            layer(x, fp8)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        records.append({"tokens": T, "ms": sorted(times)[len(times) // 2]})
    out = {"baseline": "pytorch-gpu", "torch": torch.__version__, "experts": experts, "records": records}
    if args.fp8 and hasattr(torch, "_scaled_mm"):
        out["fp8_tflops"] = dense_fp8_tflops(dev)
        block = dense_fp8_tflops(dev, block=True)
        if block is not None:
            out["fp8_block_tflops"] = block
    print(json.dumps(out), flush=True)


def sustained_ms(fn, runs=20):
    """The median ms of `runs` calls of `fn`, each timed by CUDA events, after a second of the
    same load (the power cap lowers the clocks within that second)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        fn()
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > 1000:
            break
    times = []
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[runs // 2]


def block_scaled(a, w):
    """A call computing a · wᵀ (fp8 e4m3 a [m, k] and w [n, k], bf16 out) through cuBLASLt with
    DeepSeek-V3's block scales, all ones: 1 × 128 for a's rows, 128 × 128 for w, laid out as
    torch._scaled_mm takes them."""
    (m, k), n = a.shape, w.shape[0]
    sa = torch.ones(k // 128, m, device=a.device).t()
    sw = torch.ones(n // 128, k // 128, device=a.device).t()
    return lambda: torch._scaled_mm(a, w.t(), sa, sw, out_dtype=torch.bfloat16)


def dense_fp8_tflops(dev, n=8192, block=False, runs=20):
    """The sustained rate of a dense n³ fp8 e4m3 matmul (torch._scaled_mm: cuBLASLt), TFLOP/s:
    the median of `runs` after a second of the same load (sustained_ms); with one scale a
    tensor, or with `block` DeepSeek-V3's block scales (block_scaled), then None where the
    installed PyTorch does not take them."""
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    if block:
        mm = block_scaled(a, w)
        try:
            mm()
        except (RuntimeError, TypeError, ValueError):
            return None
    else:
        one = torch.ones((), device=dev)

        def mm():
            return torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.bfloat16)

    return 2 * n**3 / (sustained_ms(mm, runs) * 1e-3) / 1e12


if __name__ == "__main__":
    main()
