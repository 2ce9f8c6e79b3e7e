"""PyTorch + NCCL baseline of an expert-parallel MoE layer, for `moeflow bench --torch-baseline`.

One process per GPU (start with `python3 -m torch.distributed.run --nproc-per-node N`). Each rank
routes its tokens (sigmoid scores, top-k, renormalised and scaled, as DeepSeek-V3 without the
group limit), moves rows to the ranks holding their experts with `all_to_all_single` (counts
exchanged first), runs its local experts with `torch._grouped_mm` and brings the outputs back
to be summed weighted; a shared expert runs on every rank's own tokens. Two forms of the
exchange, each timed: one row per (token, slot) each way (`ms`: as Megatron's all-to-all
token dispatcher moves them), and one row per (token, rank serving it) each
way, the serving rank summing its slots (`per_rank_ms`: DeepEP's form, as moeflow's
all-to-all-v moves rows). The two forms' outputs are checked against each other first. Prints
one JSON record per token count on rank 0: the median over runs of the slowest rank's
CUDA-event time from a start the GPUs share, and the median dispatch and combine times.
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

    def route(x):
        """Routing weights and expert ids [T, k] of the tokens x."""
        scores = (x.float() @ gate.T).sigmoid()
        w, ids = scores.topk(k, dim=-1)
        return w / w.sum(-1, keepdim=True) * 2.5, ids

    def exchange(t, send, recv):
        """t's rows [sum(send), ...] sent `send[r]` to rank r, `recv[r]` received from it."""
        got = t.new_empty((sum(recv),) + tuple(t.shape[1:]))
        dist.all_to_all_single(got, t, recv, send)
        return got

    def counts(send):
        """(rows to each rank, rows from each) as lists, the second exchanged."""
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return send.tolist(), recv.tolist()

    def experts(rows, eids):
        """The local experts' bf16 outputs [P, H] for rows [P, H], row p through local expert
        eids[p], in the rows' order (grouped by expert for torch._grouped_mm and back)."""
        if rows.shape[0] == 0:
            return rows.new_empty(0, H)
        order = eids.argsort(stable=True)
        offs = torch.cumsum(torch.bincount(eids, minlength=El), 0).int()
        h = torch._grouped_mm(rows[order], w13.transpose(-2, -1), offs=offs)
        gt, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gt) * up, w2.transpose(-2, -1), offs=offs)
        out = torch.empty_like(y)
        out[order] = y
        return out

    def with_shared(x, out):
        if sw13 is not None:
            sh = x @ sw13.T
            a, b = sh.chunk(2, dim=-1)
            out += ((F.silu(a) * b) @ sw2.T).float()
        return out

    def per_slot(x, marks):
        """Each (token, slot) row to the rank of its expert and its output back (Megatron's
        all-to-all dispatcher): k rows a token each way."""
        T = x.shape[0]
        w, ids = route(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        rows, local_ids = x[order // k], (flat[order] % El).int()
        send = torch.bincount(flat // El, minlength=world)
        marks[0].record()
        sc, rc = counts(send)
        got, got_ids = exchange(rows, sc, rc), exchange(local_ids, sc, rc)
        marks[1].record()
        y = experts(got, got_ids)
        marks[2].record()
        home = exchange(y, rc, sc)
        marks[3].record()
        res = torch.empty_like(home)
        res[order] = home
        return with_shared(x, (res.view(T, k, H).float() * w.unsqueeze(-1)).sum(1))

    def per_rank(x, marks):
        """Each token's row once to every rank serving one of its slots, with its k local ids
        (-1 where another rank serves the slot) and weights; that rank sends back one weighted
        sum over its slots in bf16 (DeepEP's dispatch and combine): at most one row a token and
        rank each way."""
        T = x.shape[0]
        w, ids = route(x)
        dest = ids // El
        hit = torch.zeros(T, world, dtype=torch.bool, device=dev).scatter_(1, dest, True)
        rk, tok = hit.t().nonzero(as_tuple=True)
        rows = x[tok]
        lid = torch.where(dest[tok] == rk[:, None], ids[tok] % El, -1).int()
        lw = w[tok]
        send = hit.sum(0)
        marks[0].record()
        sc, rc = counts(send)
        got, gid, gw = exchange(rows, sc, rc), exchange(lid, sc, rc), exchange(lw, sc, rc)
        marks[1].record()
        r, j = (gid >= 0).nonzero(as_tuple=True)
        y = experts(got[r], gid[r, j])
        back = torch.zeros(got.shape[0], H, device=dev).index_add_(0, r, y.float() * gw[r, j, None])
        back = back.to(torch.bfloat16)
        marks[2].record()
        home = exchange(back, rc, sc)
        marks[3].record()
        return with_shared(x, torch.zeros(T, H, device=dev).index_add_(0, tok, home.float()))

    align = torch.zeros(1, device=dev)

    def timed(layer, x):
        """(layer ms of the slowest rank, dispatch ms, combine ms), medians over the runs."""
        ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        for _ in range(3):
            layer(x, [ev() for _ in range(4)])
        totals, disp, comb = [], [], []
        for _ in range(args.runs):
            dist.barrier()
            # The GPUs start together (an all-reduce on the stream before the first event), as
            # moeflow's timed runs do, rather than when each host's launches reach its GPU.
            dist.all_reduce(align)
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
        return med(totals), med(disp), med(comb)

    records = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = rand(T, H, scale=1.0)
        # The two forms compute the same layer; the per-rank one rounds each rank's sum to
        # bf16 where the other sums every slot's bf16 row in f32.
        marks = [torch.cuda.Event() for _ in range(4)]
        a, b = per_slot(x, marks), per_rank(x, marks)
        err = torch.tensor([((a - b).norm() / a.norm().clamp_min(1e-30)).item()], device=dev)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        assert err.item() < 1e-2, f"the two forms differ by {err.item():.2e} at {T} tokens"
        ms, disp, comb = timed(per_slot, x)
        dms, ddisp, dcomb = timed(per_rank, x)
        records.append({
            "tokens": T, "ms": ms, "dispatch_ms": disp, "combine_ms": comb,
            "per_rank_ms": dms, "per_rank_dispatch_ms": ddisp, "per_rank_combine_ms": dcomb,
            "forms_rel_err": err.item(),
        })
    if rank == 0:
        print(json.dumps({"baseline": "pytorch+nccl", "torch": torch.__version__, "ep": world, "records": records}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
