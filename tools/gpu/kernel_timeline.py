"""Prints the kernels of two late layer calls on each GPU from a trace of
tools/gpu/kernel_trace.c: a call runs from 150 µs before one launch of the anchor kernel (the
router's, by default) to 150 µs before the next; each line gives the start (µs into the call),
the duration (µs), the stream, the blocks and the kernel's name. Then the two shortest calls
(with the anchor at 0 µs): where the layer replays CUDA graphs, these are replays back to back,
while the late calls are `bench`'s stage-timed direct ones.

    python3 tools/gpu/kernel_timeline.py TRACE [ANCHOR_KERNEL]
"""

import sys

LEAD_NS = 150_000


def main():
    trace = sys.argv[1]
    anchor = sys.argv[2] if len(sys.argv) > 2 else "router_partials_tf32_sm90"
    records = []
    for line in open(trace):
        kind, dev, stream, start, end, blocks, _, name = line.split(maxsplit=7)
        records.append((int(dev), int(stream), int(start), int(end), blocks, name.strip()))
    for dev in sorted({r[0] for r in records}):
        mine = sorted((r for r in records if r[0] == dev), key=lambda r: r[2])
        starts = [r[2] for r in mine if anchor in r[5]]
        print(f"== device {dev}: {len(mine)} records, {len(starts)} launches of {anchor}")
        for i in (-3, -2):
            if len(starts) < 3:
                break
            lo, hi = starts[i] - LEAD_NS, starts[i + 1] - LEAD_NS
            print(f"-- call {i}: {(hi - lo) / 1e3:.1f} µs to the next")
            show(mine, lo, hi)
        spans = [(starts[i + 1] - starts[i], i) for i in range(1, len(starts) - 2)]
        for span, i in sorted(spans)[:2]:
            print(f"-- shortest call, {i}: {span / 1e3:.1f} µs to the next")
            show(mine, starts[i], starts[i + 1] - LEAD_NS // 10, LEAD_NS // 10)


def show(records, lo, hi, lead=0):
    """Prints the records that start in [lo - lead, hi), their starts from lo."""
    for _, stream, start, end, blocks, name in records:
        if lo - lead <= start < hi:
            print(f"{(start - lo) / 1e3:9.1f} {(end - start) / 1e3:8.1f}  s{stream:<3} g{blocks:<6} {name[:60]}")


if __name__ == "__main__":
    main()
