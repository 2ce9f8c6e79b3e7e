// Quantization of rows and weights (int8, fp8 e4m3 per group or per 128 × 128 block, MXFP8),
// bit for bit as crates/moeflow/src/quant computes it on the CPU, and its inverse. (Compiled
// after common.cu.)

extern "C" {

__device__ unsigned char fp8_e4m3_encode(float v) {
#if __CUDA_ARCH__ >= 890
    // The hardware conversion: the same round-to-nearest-even and saturation at ±448 as the
    // arithmetic below, in one instruction (the arithmetic made quantization
    // instruction-bound).
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(pair) : "f"(0.0f), "f"(v));
    return (unsigned char)(pair & 0xff);
#else
    v = fminf(fmaxf(v, -448.0f), 448.0f);
    unsigned char sign = v < 0.0f ? 0x80 : 0;
    float a = fabsf(v);
    if (a == 0.0f) return sign;
    int e;
    frexpf(a, &e);  // a = m * 2^e, m in [0.5, 1)
    e -= 1;         // a = m' * 2^e, m' in [1, 2)
    if (e < -6) {   // subnormal: multiples of 2^-9
        int q = (int)rintf(a * 512.0f);
        return sign | (unsigned char)q;  // q == 8 is the smallest normal, code 0x08
    }
    int q = (int)rintf(ldexpf(a, -e) * 8.0f);  // 8..16
    if (q == 16) { q = 8; e += 1; }
    return sign | (unsigned char)(((e + 7) << 3) | (q - 8));
#endif
}

__device__ float fp8_e4m3_decode(unsigned char c) {
#if __CUDA_ARCH__ >= 890
    unsigned halves;
    float v;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(halves) : "h"((unsigned short)c));
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.f32.f16 %0, l;\n}\n" : "=f"(v) : "r"(halves));
    return v;
#else
    int e = (c >> 3) & 15, m = c & 7;
    float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
    return (c & 0x80) ? -v : v;
#endif
}

__device__ int ceil_log2(float v) {
    unsigned int b = __float_as_uint(v);
    int e = (b >> 23) & 0xff;
    if (e == 0) return -127;
    return e - 127 + ((b & 0x7fffff) != 0);
}

}  // extern "C"

// The scale of a group whose largest magnitude is `a`, for `kind` as below.
__device__ __forceinline__ float group_scale(float a, int kind) {
    if (kind == 1) return a / 127.0f;
    if (kind == 2) return a / 448.0f;
    return a == 0.0f ? 0.0f : ldexpf(1.0f, max(-127, min(127, ceil_log2(a / 448.0f))));
}

// The code of `v` (a value over its group's scale `s` > 0) for `kind`, and the value it stands for.
__device__ __forceinline__ unsigned char quantize_code(float v, int kind) {
    return kind == 1 ? (unsigned char)(signed char)fminf(fmaxf(roundf(v), -127.0f), 127.0f) : fp8_e4m3_encode(v);
}
__device__ __forceinline__ float code_value(unsigned char q, int kind) {
    return kind == 1 ? (float)(signed char)q : fp8_e4m3_decode(q);
}

// Whether a group's scale s lies where quotient_of_bf16 holds, [2^-60, 2^60]; groups of tiny
// or huge values (and s = 0) divide instead.
__device__ __forceinline__ bool quotients_by_fma(float s) {
    return s >= 8.67361738e-19f && s <= 1.15292150e18f;  // 2^-60, 2^60
}

// v / s rounded to f32 as the division rounds it, for a bf16 value v and a group's scale s in
// [2^-60, 2^60] (as group_scale gives it for a group of bf16 values whose largest magnitude a
// is at least |v|), from y = 1 / s rounded: the product q = v · y, its remainder v - s · q (one
// FMA, exact) and q plus the remainder times y (another), three operations where the division
// takes about eight and a branch. It gives the division's bits for every pair of bf16
// significands of v and a, v up to 2^21 below a (tools/bf16_quotient_check.py, and the GPU
// test of every pair); further below, both quotients get code 0. Within the range of s
// everything scales by powers of two, and a power-of-two s (MXFP8's) leaves no remainder.
// Zero keeps its sign.
__device__ __forceinline__ float quotient_of_bf16(float v, float s, float y) {
    const float q = v * y;
    return v == 0.0f ? v : fmaf(fmaf(-s, q, v), y, q);
}

// The `kind` code of v in a group of scale s: v / s as the division rounds it, by
// quotient_of_bf16 (y = 1 / s) where `products` (a bf16 v and quotients_by_fma(s)), else by
// the division; 0 in a group of zeros (s = 0).
__device__ __forceinline__ unsigned char group_code(float v, float s, float y, bool products, int kind) {
    return products ? quantize_code(quotient_of_bf16(v, s, y), kind) : s > 0.0f ? quantize_code(v / s, kind) : 0;
}

// One group of 128 bf16 values quantized to fp8 e4m3 with the scale amax / 448 (kind 2), by a
// warp: lane l holds values 4 l .. 4 l + 3 in v (zeros for a group cut short by its row's end)
// and gets their codes in q; returns the group's scale, in every lane. quantize_rows_of gives
// the same values the same codes and scale.
__device__ float fp8_group128_of_warp(const float* v, unsigned char* q) {
    float a = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    const float s = group_scale(a, 2), y = 1.0f / s;
    const bool products = quotients_by_fma(s);
#pragma unroll
    for (int j = 0; j < 4; j++) q[j] = group_code(v[j], s, y, products, 2);
    return s;
}

__device__ __forceinline__ void load16(const float* p, float* v) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float4 q = ((const float4*)p)[j];
        v[4 * j] = q.x, v[4 * j + 1] = q.y, v[4 * j + 2] = q.z, v[4 * j + 3] = q.w;
    }
}
__device__ __forceinline__ void load16(const bf16_t* p, float* v) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        uint4 q = ((const uint4*)p)[j];
        unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[8 * j + 2 * i] = __uint_as_float(w[i] << 16);
            v[8 * j + 2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
}

// Whether rows of H values in groups of `group` take quantize_rows128 (and its launch shape:
// quantize_launch in quant.rs decides alike).
__device__ __forceinline__ bool whole_groups_of_128(int H, int group) { return group == 128 && H % 128 == 0; }

// Groups of exactly 128 values, H a multiple of 128: eight lanes a (row, group), sixteen
// neighbouring values a lane held in registers, read and written in 16-byte accesses, the
// (row, group) pairs strided over the whole grid (a block per row made the launch bound by
// block starts). The same codes and scales as quantize_row_group.
template <typename T>
__device__ void quantize_rows128(const T* x, long rows, int H, int kind, const int* counts, int cap,
                                 unsigned char* codes, float* scales, bf16_t* values) {
    const int groups = H / 128, lane = threadIdx.x % 8;
    const unsigned team = 0xffu << (threadIdx.x % 32 / 8 * 8);
    const long items = rows * groups, teams = (long)gridDim.x * blockDim.x / 8;
    for (long item = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 8; item < items; item += teams) {
        const long r = item / groups;
        const int g = (int)(item % groups);
        if (counts && (int)(r % cap) >= counts[r / cap]) continue;
        const long at = r * H + g * 128 + 16 * lane;
        float v[16];
        load16(x + at, v);
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) a = fmaxf(a, fabsf(v[j]));
        for (int o = 4; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(team, a, o));
        const float s = group_scale(a, kind);
        if (scales && lane == 0) scales[r * groups + g] = s;
        unsigned char q[16];
        const bool products = sizeof(T) == 2 && quotients_by_fma(s);  // bf16 rows
        const float y = 1.0f / s;
#pragma unroll
        for (int j = 0; j < 16; j++) q[j] = group_code(v[j], s, y, products, kind);
        if (codes) {
            unsigned w[4];
#pragma unroll
            for (int i = 0; i < 4; i++) w[i] = q[4 * i] | (q[4 * i + 1] << 8) | (q[4 * i + 2] << 16) | ((unsigned)q[4 * i + 3] << 24);
            *(uint4*)(codes + at) = make_uint4(w[0], w[1], w[2], w[3]);
        }
        if (values) {
            unsigned w[8];
#pragma unroll
            for (int i = 0; i < 8; i++)
                w[i] = f32_to_bf16(code_value(q[2 * i], kind) * s) |
                       ((unsigned)f32_to_bf16(code_value(q[2 * i + 1], kind) * s) << 16);
            ((uint4*)(values + at))[0] = make_uint4(w[0], w[1], w[2], w[3]);
            ((uint4*)(values + at))[1] = make_uint4(w[4], w[5], w[6], w[7]);
        }
    }
}

// One warp per (row, group), rows strided over grid.x, groups over grid.y and the block's warps.
template <typename T>
__device__ void quantize_rows_any(const T* x, long rows, int H, int group, int kind, const int* counts, int cap,
                                  unsigned char* codes, float* scales, bf16_t* values) {
    const int lane = threadIdx.x % 32, groups = (H + group - 1) / group;
    const int g = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
    if (g >= groups) return;
    const int lo = g * group, hi = min(H, lo + group);
    for (long r = blockIdx.x; r < rows; r += gridDim.x) {
        if (counts && (int)(r % cap) >= counts[r / cap]) continue;
        const T* row = x + r * H;
        float a = 0.0f;
        for (int i = lo + lane; i < hi; i += 32) a = fmaxf(a, fabsf(to_f32(row[i])));
        for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        const float s = group_scale(a, kind);
        if (scales && lane == 0) scales[r * groups + g] = s;
        for (int i = lo + lane; i < hi; i += 32) {
            const unsigned char q = s > 0.0f ? quantize_code(to_f32(row[i]) / s, kind) : 0;
            if (codes) codes[r * H + i] = q;
            if (values) values[r * H + i] = f32_to_bf16(code_value(q, kind) * s);
        }
    }
}

// Rows x [rows, H] to codes [rows, H] and scales [rows, ceil(H / group)]: `kind` 1 int8
// (amax / 127), 2 fp8 (amax / 448), 3 MXFP8 (power-of-two scale per group). With `counts`,
// rows r past counts[r / cap] (padding of the padded layout) are skipped. `codes` and `scales`
// may be null (not written); with `values` (may be `x` itself: each lane rewrites only values
// it read), the values the codes stand for (code · scale) are written there as bf16 too.
// Launch shape: quantize_launch in quant.rs.
template <typename T>
__device__ void quantize_rows_of(const T* x, long rows, int H, int group, int kind, const int* counts, int cap,
                                 unsigned char* codes, float* scales, bf16_t* values) {
    if (whole_groups_of_128(H, group)) quantize_rows128(x, rows, H, kind, counts, cap, codes, scales, values);
    else quantize_rows_any(x, rows, H, group, kind, counts, cap, codes, scales, values);
}
extern "C" {

// f32 rows to codes and scales (see quantize_rows_of).
__global__ void quantize_rows(const float* x, long rows, int H, int group, int kind, unsigned char* codes,
                              float* scales) {
    quantize_rows_of(x, rows, H, group, kind, (const int*)0, 1, codes, scales, (bf16_t*)0);
}

// Blocks of 256 threads a SM that quantize_rows_bf16 asks room for: six on Hopper (40
// registers a thread, against 51 unbounded): the pass is bound by its loads' latency, so more
// of them in flight (docs/tuning.md). Ampere's code spills at 40 and at 48 registers, so four
// there (64; `kernels_compile_for_ampere_and_hopper` prints spills).
#if __CUDA_ARCH__ >= 900
#define QUANT_BLOCKS_PER_SM 6
#else
#define QUANT_BLOCKS_PER_SM 4
#endif

// bf16 rows to codes and scales, or to the values they stand for (see quantize_rows_of).
__global__ void __launch_bounds__(256, QUANT_BLOCKS_PER_SM)
    quantize_rows_bf16(const bf16_t* x, long rows, int H, int group, int kind, const int* counts, int cap,
                       unsigned char* codes, float* scales, bf16_t* values) {
    quantize_rows_of(x, rows, H, group, kind, counts, cap, codes, scales, values);
}

__global__ void dequantize_rows(const unsigned char* codes, const float* scales, long n, int H, int group, int kind, float* out) {
    int groups = (H + group - 1) / group;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        long r = i / H;
        int c = i % H;
        float v = kind == 1 ? (float)(signed char)codes[i] : fp8_e4m3_decode(codes[i]);
        out[i] = v * scales[r * groups + c / group];
    }
}

// fp8 e4m3 codes of `count` bf16 matrices [N, K] stored back to back in `w`, one f32 scale per
// 128 × 128 block (WeightQuant::Fp8Block(128) on the CPU, bit for bit): scale = amax / 448 (0
// for an all-zero block, whose codes are 0), code = encode(v / scale); scales [count, ceil(N /
// 128), ceil(K / 128)]. `w` is overwritten with decode(code) · scale as bf16, the values the codes
// stand for. Grid (ceil(K / 128), ceil(N / 128), count), 256 threads.
__global__ void quantize_weight_blocks_fp8(bf16_t* w, int N, int K, unsigned char* codes, float* scales) {
    __shared__ float red[8];
    int bj = blockIdx.x, bi = blockIdx.y, e = blockIdx.z;
    int r0 = bi * 128, c0 = bj * 128, rn = min(128, N - r0), cn = min(128, K - c0);
    long base = (long)e * N * K;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < rn * cn; i += blockDim.x)
        amax = fmaxf(amax, fabsf(bf16_to_f32(w[base + (long)(r0 + i / cn) * K + c0 + i % cn])));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, red[i]);
    float scale = amax / 448.0f;
    if (threadIdx.x == 0) scales[((long)e * gridDim.y + bi) * gridDim.x + bj] = scale;
    for (int i = threadIdx.x; i < rn * cn; i += blockDim.x) {
        long at = base + (long)(r0 + i / cn) * K + c0 + i % cn;
        unsigned char q = scale > 0.0f ? fp8_e4m3_encode(bf16_to_f32(w[at]) / scale) : 0;
        codes[at] = q;
        w[at] = f32_to_bf16(fp8_e4m3_decode(q) * scale);
    }
}

}  // extern "C"
