"""The Python call's overhead over the Rust call: median time of `layer(x)` from Python and of
the same forward timed inside Rust, at one token (or --tokens), on random weights.

    python crates/moeflow-py/bench/overhead.py                      # CPU, numpy input
    python crates/moeflow-py/bench/overhead.py --device cuda:0      # GPU, torch CUDA input
"""

import argparse
import statistics
import time

import numpy as np

import moeflow


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=2000)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    h, i, e = a.hidden, a.inter, a.experts

    def uniform(shape, fan_in):
        return (rng.uniform(-1, 1, shape) / np.sqrt(fan_in)).astype(np.float32)

    layer = moeflow.MoeLayer.from_weights(uniform((e, h), h), w13=uniform((e, 2 * i, h), h),
                                          w2=uniform((e, h, i), i), top_k=a.top_k, device=a.device)
    x = rng.uniform(-1, 1, (a.tokens, h)).astype(np.float32)
    if a.device.startswith("cuda"):
        import torch

        x_in = torch.from_numpy(x).to(a.device)
    else:
        x_in = x
    for _ in range(50):
        layer(x_in)
    times = []
    for _ in range(a.iterations):
        start = time.perf_counter()
        layer(x_in)
        times.append(time.perf_counter() - start)
    python = statistics.median(times)
    rust = layer._layer.rust_forward_seconds(x, a.iterations)
    print(f"layer: {layer.describe()}")
    print(f"{a.tokens} token(s), H {h}, I {i}, {e} experts, top-{a.top_k}, {a.iterations} calls each")
    print(f"python call  median {python * 1e6:9.2f} us")
    print(f"rust call    median {rust * 1e6:9.2f} us")
    print(f"overhead            {(python - rust) * 1e6:9.2f} us")


if __name__ == "__main__":
    main()
