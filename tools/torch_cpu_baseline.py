"""PyTorch CPU baseline of one MoE layer, for `moeflow bench --torch-baseline` on CPU.

OLMoE-1B-7B shapes by default (hidden 2048, expert width 1024, 64 experts, top-8). The layer is
written as a PyTorch user would: router logits, softmax, top-k, then for every expert hit its
rows gathered, `x @ w13[e].T`, SiLU and multiply, `@ w2[e].T`, weighted and `index_add_`-ed
into the output, plus a shared expert on every token when `--shared-inter` is not 0. (The
routing and activation are OLMoE's whatever the preset; they are a small part of the time.)
Weights are bf16 or f32 (`--dtype`); with bf16 the matmuls run either on the rows cast to f32
against weights widened once (`--compute f32`, the default, at twice the weight memory) or in
bf16 (`--compute bf16`, PyTorch's own bf16 kernels: the faster on CPUs with AVX512-BF16, 167
against 62 GFLOP/s at 256 tokens on the Zen 4 development VM with PyTorch 2.15).
`moeflow bench --torch-baseline` passes `--compute bf16` when its CPU experts take bf16 dot
products and `--compute f32` when they widen the weights, so both sides do the same
arithmetic. Prints one JSON
line: per token count the median over `--runs` timed forwards after two warm-ups, and GFLOP/s
of the routed experts' matmuls (as moeflow counts them).
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--shared-inter", type=int, default=0)
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--compute", choices=["bf16", "f32"], default="f32")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    H, I, E, k = args.hidden, args.inter, args.experts, args.top_k
    g = torch.Generator().manual_seed(1234)
    wdt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cdt = torch.float32 if args.dtype == "f32" or args.compute == "f32" else torch.bfloat16
    gate_w = torch.randn(E, H, generator=g) * 0.02
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.02).to(wdt).to(cdt)
    w2 = (torch.randn(E, H, I, generator=g) * 0.02).to(wdt).to(cdt)
    S = args.shared_inter
    s13 = (torch.randn(2 * S, H, generator=g) * 0.02).to(wdt).to(cdt)
    s2 = (torch.randn(H, S, generator=g) * 0.02).to(wdt).to(cdt)

    def forward(x):
        probs = F.softmax(x @ gate_w.T, dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        out = torch.zeros_like(x)
        xc = x.to(cdt)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            tok = slots // k
            h = xc[tok] @ w13[e].T
            a = F.silu(h[:, :I]) * h[:, I:]
            y = (a @ w2[e].T).float()
            out.index_add_(0, tok, y * weights.flatten()[slots, None])
        if S > 0:
            h = xc @ s13.T
            out += ((F.silu(h[:, :S]) * h[:, S:]) @ s2.T).float()
        return out

    records = []
    for t in [int(s) for s in args.tokens.split(",")]:
        x = torch.randn(t, H, generator=g)
        with torch.inference_mode():
            forward(x)
            forward(x)
            times = []
            for _ in range(args.runs):
                s = time.perf_counter()
                forward(x)
                times.append(time.perf_counter() - s)
        ms = statistics.median(times) * 1e3
        flops = 2.0 * t * k * (2 * I * H + H * I)
        records.append({"tokens": t, "ms": round(ms, 3), "gflops": round(flops / ms / 1e6, 1)})
    print(
        json.dumps(
            {
                "baseline": "pytorch-cpu",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "dtype": args.dtype,
                "compute": "f32" if cdt == torch.float32 else "bf16",
                "records": records,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
