"""PyTorch baseline of one MoE layer on one GPU, for `moeflow bench --backend cuda --torch-baseline`.

The layer as a PyTorch user writes it today: sigmoid router scores, top-k, renormalised and
scaled (DeepSeek-V3 without the group limit), rows sorted by expert with `argsort`, both expert
matmuls as `torch._grouped_mm` over bf16 weights with SiLU-and-mul between them, outputs put
back in slot order and summed weighted; a shared expert on every token when `--shared-inter` is
not 0. Prints one JSON line: per token count the median CUDA-event time over `--runs` forwards
after three warm-ups.
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

    def layer(x):
        T = x.shape[0]
        scores = (x.float() @ gate.T).sigmoid()
        w, ids = scores.topk(k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * 2.5
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        xr = x[order // k]
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).int()
        h = torch._grouped_mm(xr, w13.transpose(-2, -1), offs=offs)
        gt, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gt) * up, w2.transpose(-2, -1), offs=offs)
        res = torch.empty_like(y)
        res[order] = y
        out = (res.view(T, k, H).float() * w.unsqueeze(-1)).sum(1)
        if sw13 is not None:
            sh = x @ sw13.T
            a, b = sh.chunk(2, dim=-1)
            out += ((F.silu(a) * b) @ sw2.T).float()
        return out

    records = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = rand(T, H, scale=1.0)
        for _ in range(3):
            layer(x)
        times = []
        for _ in range(args.runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            layer(x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        records.append({"tokens": T, "ms": sorted(times)[len(times) // 2]})
    print(json.dumps({"baseline": "pytorch-gpu", "torch": torch.__version__, "records": records}), flush=True)


if __name__ == "__main__":
    main()
