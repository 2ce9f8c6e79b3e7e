#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction, from Nsight Compute's source view.

Profile with the stall sampling sections and export the first kernel's SASS view as CSV:

    ncu --clock-control none -k regex:'grouped_gemm_fp8_sm90$' --launch-skip 4 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o /tmp/gemm moeflow bench ...
    ncu -i /tmp/gemm.ncu-rep --page source --csv --print-source sass > /tmp/gemm.csv
    python3 tools/gpu/sass_stalls.py /tmp/gemm.csv [TOP]

Prints the TOP instructions (default 30) with the most stall samples and their three largest
reasons, then the instructions grouped by how many times a warp ran them: in a persistent
GEMM one count is the loop over blocks, another the once-a-tile code (a tile's start, its
last block, its epilogue), so their shares of the samples say what the tile changes cost.
"""
import csv
import sys
from collections import defaultdict


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rows = list(csv.reader(open(sys.argv[1])))
    head = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    names = rows[head]
    body = []
    for r in rows[head + 1 :]:
        if len(r) != len(names) or r[0] in ("Kernel Name", "Address"):
            break  # the next kernel's view, if the export holds several
        body.append(r)
    at = {n: names.index(n) for n in ("Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")}
    reasons = [(i, n[len("stall_") :]) for i, n in enumerate(names) if n.startswith("stall_") and "Not Issued" not in n]
    samples = [number(r[at["Warp Stall Sampling (All Samples)"]]) for r in body]
    total = sum(samples) or 1.0
    print(f"{len(body)} instructions, {total:.0f} stall samples")
    for k in sorted(range(len(body)), key=lambda k: -samples[k])[:top]:
        r = body[k]
        why = sorted(((number(r[i]), n) for i, n in reasons), reverse=True)[:3]
        print(
            f"{r[at['Address']][-6:]:>6} {samples[k] / total:6.1%} "
            f"ran {number(r[at['Instructions Executed']]):>10.0f}  {r[at['Source']][:56]:56} "
            + " ".join(f"{n}={v:.0f}" for v, n in why if v)
        )
    groups = defaultdict(lambda: [0, 0.0])
    for r, s in zip(body, samples):
        ran = number(r[at["Instructions Executed"]])
        if ran:
            groups[ran][0] += 1
            groups[ran][1] += s
    print("\nby times run (warp instructions): instructions, share of the samples")
    for ran, (count, s) in sorted(groups.items(), key=lambda g: -g[1][1])[:12]:
        print(f"{ran:>12.0f} {count:6} {s / total:6.1%}")


if __name__ == "__main__":
    main()
