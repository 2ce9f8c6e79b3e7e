"""The Python call's overhead over the Rust call: median time of `layer(x)` from Python and of
the same forward timed inside Rust, at one token (or --tokens), on random weights.

    python crates/moeflow-py/bench/overhead.py                      # CPU, numpy input
    python crates/moeflow-py/bench/overhead.py --device cuda:0      # GPU, torch CUDA input

On a GPU both sides run the device path (`forward_device` on device memory, torch's current
stream) and each call is followed by a wait for the GPU outside the call's own time: "call" is
the time until the call returns (the layer enqueued, where it does not wait), "call + GPU" the
time until the GPU has finished it.
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
    print(f"layer: {layer.describe()}")
    print(f"{a.tokens} token(s), H {h}, I {i}, {e} experts, top-{a.top_k}, {a.iterations} calls each")
    if a.device.startswith("cuda"):
        gpu(layer, x, a)
        return
    for _ in range(50):
        layer(x)
    times = []
    for _ in range(a.iterations):
        start = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - start)
    python = statistics.median(times)
    rust = layer._layer.rust_forward_seconds(x, a.iterations)
    print(f"python call  median {python * 1e6:9.2f} us")
    print(f"rust call    median {rust * 1e6:9.2f} us")
    print(f"overhead            {(python - rust) * 1e6:9.2f} us")


def gpu(layer, x, a):
    """The device path from Python (`layer(x)` on a CUDA tensor) against `forward_device` timed
    in Rust, on the same device buffers and stream."""
    import torch

    x_in = torch.from_numpy(x).to(a.device)
    out = torch.empty_like(x_in)
    stream = torch.cuda.current_stream(x_in.device).cuda_stream
    for _ in range(50):
        layer(x_in)
    layer.synchronize()
    calls, totals = [], []
    for _ in range(a.iterations):
        start = time.perf_counter()
        layer(x_in)
        calls.append(time.perf_counter() - start)
        layer._layer.synchronize(stream)
        totals.append(time.perf_counter() - start)
    rust_call, rust_total = layer._layer.rust_forward_device_seconds(
        x_in.data_ptr(), out.data_ptr(), a.tokens, stream, a.iterations)
    python_call, python_total = statistics.median(calls), statistics.median(totals)
    print(f"{'':13}{'call':>12}{'call + GPU':>14}")
    print(f"{'python':13}{python_call * 1e6:9.2f} us{python_total * 1e6:11.2f} us")
    print(f"{'rust':13}{rust_call * 1e6:9.2f} us{rust_total * 1e6:11.2f} us")
    print(f"{'overhead':13}{(python_call - rust_call) * 1e6:9.2f} us{(python_total - rust_total) * 1e6:11.2f} us")


if __name__ == "__main__":
    main()
