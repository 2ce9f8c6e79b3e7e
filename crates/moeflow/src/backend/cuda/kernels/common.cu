// moeflow's CUDA kernels, the pieces the other files use: the bf16 type and its conversions,
// the shared expert's gate, fills of generated weights, the clock stamp of graph stages, ints
// written from a launch's parameters, a bias added to rows, the last block of a grid. The
// kernel files are compiled as one source, in the order of KERNELS in mod.rs, this one first.
// bf16 values are handled as raw 16-bit patterns (no header needed under NVRTC).
typedef unsigned short bf16_t;
typedef unsigned long long u64;
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16_t v) { return bf16_to_f32(v); }
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                          // round to nearest even
    return (bf16_t)(u >> 16);
}

// The shared expert's gate of token t: sigmoid(x[t] . gate), or 1 without a gate. Called by
// every thread of a block; `red` is the block's 32-float scratch.
__device__ float shared_gate(const float* x, const float* gate, long t, int H, float* red) {
    if (!gate) return 1.0f;
    float part = 0.0f;
    for (int h = threadIdx.x; h < H; h += blockDim.x) part += x[t * H + h] * gate[h];
    for (int o = 16; o > 0; o >>= 1) part += __shfl_down_sync(0xffffffffu, part, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
        float z = 0.0f;
        for (int i = 0; i < (int)(blockDim.x + 31) / 32; i++) z += red[i];
        red[0] = 1.0f / (1.0f + __expf(-z));
    }
    __syncthreads();
    return red[0];
}

extern "C" {

// y = x rounded to bf16: eight values a step (two 16-byte loads, one 16-byte store) when both
// are 16-byte aligned, then the rest one by one (one value a step is slower; docs/tuning.md).
__global__ void f32_to_bf16_kernel(const float* x, bf16_t* y, long n) {
    const long first = blockIdx.x * (long)blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
    const long n8 = (((u64)x | (u64)y) & 15) == 0 ? n / 8 : 0;
    for (long i = first; i < n8; i += stride) {
        const float4 a = ((const float4*)x)[2 * i], b = ((const float4*)x)[2 * i + 1];
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        unsigned int o[4];
        for (int j = 0; j < 4; j++) o[j] = (unsigned int)f32_to_bf16(v[2 * j]) | ((unsigned int)f32_to_bf16(v[2 * j + 1]) << 16);
        ((uint4*)y)[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
    for (long i = 8 * n8 + first; i < n; i += stride) y[i] = f32_to_bf16(x[i]);
}

// y = x widened to f32 (every bf16 value is an f32 value), NaN and infinities as they are.
__global__ void bf16_to_f32_kernel(const bf16_t* x, float* y, long n) {
    const long first = blockIdx.x * (long)blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
    for (long i = first; i < n; i += stride) y[i] = bf16_to_f32(x[i]);
}

// The deterministic uniform value in [-scale, scale) of (seed, index i): a splitmix64 hash of
// the index, its top 24 bits as the fraction.
__device__ __forceinline__ float uniform_at(u64 seed, long i, float scale) {
    u64 z = seed + 0x9E3779B97F4A7C15ull * (u64)(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (2.0f * ((float)(z >> 40) / 16777216.0f) - 1.0f) * scale;
}

// Deterministic uniform values in [-scale, scale) from (seed, index): for large benchmarks.
__global__ void fill_uniform_bf16(bf16_t* y, long n, u64 seed, float scale) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = f32_to_bf16(uniform_at(seed, i, scale));
}

// *at = the GPU's global nanosecond clock: a stage boundary inside a CUDA graph, where events
// are not timed. One thread.
__global__ void stamp_clock(u64* at) {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *at = now;
}

// The same values as f32 (the random layer's weights and inputs).
__global__ void fill_uniform_f32(float* y, long n, u64 seed, float scale) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = uniform_at(seed, i, scale);
}

// Ints from the host, by value (write_ints): 1 KiB, a push's lane table at EP 4 in one launch.
#define HOST_INTS 256
struct HostInts {
    int n;
    int v[HOST_INTS];
};

// dst[i] = ints.v[i] for i < ints.n: host values written in stream order from the launch's own
// parameters. A copy from pageable host memory may wait for the stream to reach it, and so hold
// back the host's next launches behind all the work queued before.
__global__ void write_ints(int* dst, HostInts ints) {
    for (int i = threadIdx.x; i < ints.n; i += blockDim.x) dst[i] = ints.v[i];
}

// logits[t, e] += bias[e]
__global__ void add_row_bias(float* x, const float* bias, int rows, int cols) {
    long n = (long)rows * cols;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) x[i] += bias[i % cols];
}

}  // extern "C"

extern "C" {

// Whether this block is the last of its grid to get here, by a counter at `ticket` (zero before
// the launch; the last block sets it back once done with it). Every thread of the block calls
// it; each block's writes before the call are visible to the last block after it.
__device__ __forceinline__ bool last_block_here(int* ticket) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Eight bf16 values of a 16-byte word as floats.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    unsigned int w[4] = {v.x, v.y, v.z, v.w};
    for (int j = 0; j < 4; j++) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

}  // extern "C"
