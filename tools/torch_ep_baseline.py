"""PyTorch + NCCL baseline of an expert-parallel MoE layer, for `moeflow bench --torch-baseline`.

One process per GPU (start with `python3 -m torch.distributed.run --nproc-per-node N`). Each rank
routes its tokens (sigmoid scores, top-k, renormalised and scaled, as DeepSeek-V3 without the
group limit), sends each (token, slot) row to the rank holding its expert with
`all_to_all_single` (counts exchanged first), runs its local experts with `torch._grouped_mm`,
sends the outputs back and sums them weighted; a shared expert runs on every rank's own tokens.
Prints one JSON record per token count on rank 0: the median over runs of the slowest rank's
CUDA-event time, and the median dispatch and combine times.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--shared-inter", type=int, default=2048)
    ap.add_argument("--tokens", default="1,128,512,4096")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    H, I, E, k = args.hidden, args.inter, args.experts, args.top_k
    assert E % world == 0, "experts must split evenly"
    El = E // world
    g = torch.Generator(device=dev).manual_seed(1234 + rank)

    def rand(*shape, scale):
        return ((torch.rand(*shape, generator=g, device=dev) * 2 - 1) * scale).to(torch.bfloat16)

    gate = rand(E, H, scale=3 / H**0.5).float()
    w13 = rand(El, 2 * I, H, scale=2 / H**0.5)
    w2 = rand(El, H, I, scale=2 / I**0.5)
    Is = args.shared_inter
    sw13 = rand(2 * Is, H, scale=2 / H**0.5) if Is else None
    sw2 = rand(H, Is, scale=2 / Is**0.5) if Is else None

    def layer(x, marks):
        T = x.shape[0]
        scores = (x.float() @ gate.T).sigmoid()
        w, ids = scores.topk(k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * 2.5
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        rows = x[order // k]
        send = torch.bincount(flat // El, minlength=world)
        recv = torch.empty_like(send)
        marks[0].record()
        dist.all_to_all_single(recv, send)
        sc, rc = send.tolist(), recv.tolist()
        got = rows.new_empty(sum(rc), H)
        dist.all_to_all_single(got, rows, rc, sc)
        local_ids = (flat[order] % El).int()
        got_ids = local_ids.new_empty(sum(rc))
        dist.all_to_all_single(got_ids, local_ids, rc, sc)
        marks[1].record()
        o2 = got_ids.argsort(stable=True)
        xr = got[o2]
        offs = torch.cumsum(torch.bincount(got_ids, minlength=El), 0).int()
        h = torch._grouped_mm(xr, w13.transpose(-2, -1), offs=offs)
        gt, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gt) * up, w2.transpose(-2, -1), offs=offs)
        back = torch.empty_like(y)
        back[o2] = y
        home = back.new_empty(sum(sc), H)
        marks[2].record()
        dist.all_to_all_single(home, back, sc, rc)
        marks[3].record()
        res = torch.empty_like(home)
        res[order] = home
        out = (res.view(T, k, H).float() * w.unsqueeze(-1)).sum(1)
        if sw13 is not None:
            sh = x @ sw13.T
            a, b = sh.chunk(2, dim=-1)
            out += ((F.silu(a) * b) @ sw2.T).float()
        return out

    records = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = rand(T, H, scale=1.0)
        ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        for _ in range(3):
            layer(x, [ev() for _ in range(4)])
        totals, disp, comb = [], [], []
        for _ in range(args.runs):
            dist.barrier()
            start, end, marks = ev(), ev(), [ev() for _ in range(4)]
            start.record()
            layer(x, marks)
            end.record()
            torch.cuda.synchronize()
            t = torch.tensor([start.elapsed_time(end)], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            totals.append(t.item())
            disp.append(marks[0].elapsed_time(marks[1]))
            comb.append(marks[2].elapsed_time(marks[3]))
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        records.append({"tokens": T, "ms": med(totals), "dispatch_ms": med(disp), "combine_ms": med(comb)})
    if rank == 0:
        print(json.dumps({"baseline": "pytorch+nccl", "torch": torch.__version__, "ep": world, "records": records}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
