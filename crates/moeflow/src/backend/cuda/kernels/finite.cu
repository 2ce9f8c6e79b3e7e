// Non-finite values of a device buffer, found in one pass: alone, or as a layer's hidden states
// are copied in and its output copied out.

extern "C" {

// Adds a warp's counts (each lane's `count` and lowest index `first`) to result = {count, first
// index}: one atomic of each kind a warp. Called by every lane of the warp.
__device__ __forceinline__ void add_count(unsigned long long count, unsigned long long first,
                                          unsigned long long* result) {
    for (int o = 16; o > 0; o >>= 1) {
        count += __shfl_xor_sync(0xffffffffu, count, o);
        unsigned long long other = __shfl_xor_sync(0xffffffffu, first, o);
        if (other < first) first = other;
    }
    if (threadIdx.x % 32 == 0 && count > 0) {
        atomicAdd(&result[0], count);
        atomicMin(&result[1], first);
    }
}

// Counts the NaN and infinite values of x[0, n) and finds the first one's index: adds the count
// to result[0] and lowers result[1] to the index (result starts as {0, ~0}); when `into` is not
// null, also copies x there with each of them as 0. Four values a step (16-byte accesses) when
// both are 16-byte aligned, then the rest one by one. Any grid of whole warps; each warp adds its
// share with one atomic of each kind.
__device__ void nonfinite_pass(const float* __restrict__ x, float* __restrict__ into, long long n,
                               unsigned long long* result) {
    unsigned long long count = 0, first = ~0ull;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    const long long n4 = (((u64)x | (u64)into) & 15) == 0 ? n / 4 : 0;
    for (long long i = start; i < n4; i += stride) {
        const float4 v = ((const float4*)x)[i];
        float a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            // All exponent bits set: infinity or NaN.
            if ((__float_as_uint(a[j]) & 0x7f800000u) == 0x7f800000u) {
                count++;
                first = min(first, (unsigned long long)(4 * i + j));
                a[j] = 0.0f;
            }
        }
        if (into) ((float4*)into)[i] = make_float4(a[0], a[1], a[2], a[3]);
    }
    for (long long i = 4 * n4 + start; i < n; i += stride) {
        float v = x[i];
        if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {
            count++;
            first = min(first, (unsigned long long)i);
            v = 0.0f;
        }
        if (into) into[i] = v;
    }
    add_count(count, first, result);
}

// The count of nonfinite_pass, x left as it is.
__global__ void count_nonfinite_f32(const float* __restrict__ x, long long n, unsigned long long* result) {
    nonfinite_pass(x, 0, n, result);
}

// Takes a batch of f32 hidden states in: the count of nonfinite_pass, x copied into `into` with
// each NaN or infinite value as 0, so that the work after it (routing, whose choices index
// memory) never meets one.
__global__ void clear_nonfinite_f32(const float* __restrict__ x, float* __restrict__ into, long long n,
                                    unsigned long long* result) {
    nonfinite_pass(x, into, n, result);
}

// Takes a batch of bf16 hidden states in: x[0, n) copied into x_bf and, when `y` is not null,
// widened into y (exact), each NaN or infinite value written as 0 in both (so that routing never
// meets one) and counted as nonfinite_pass counts them into `result`. Eight values a step (one
// 16-byte load, one and two 16-byte stores) when all are 16-byte aligned, then the rest one by
// one. Any grid of whole warps.
__global__ void clear_nonfinite_bf16(const bf16_t* __restrict__ x, bf16_t* __restrict__ x_bf, float* __restrict__ y,
                                     long long n, unsigned long long* result) {
    unsigned long long count = 0, first = ~0ull;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    const long long n8 = (((u64)x | (u64)x_bf | (u64)y) & 15) == 0 ? n / 8 : 0;
    for (long long i = start; i < n8; i += stride) {
        const uint4 v = ((const uint4*)x)[i];
        unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            // All exponent bits set: infinity or NaN.
            if (((w[j / 2] >> (16 * (j % 2))) & 0x7f80u) == 0x7f80u) {
                count++;
                first = min(first, (unsigned long long)(8 * i + j));
                w[j / 2] &= j % 2 ? 0x0000ffffu : 0xffff0000u;
            }
        }
        ((uint4*)x_bf)[i] = make_uint4(w[0], w[1], w[2], w[3]);
        if (y) {
            ((float4*)y)[2 * i] = make_float4(__uint_as_float(w[0] << 16), __uint_as_float(w[0] & 0xffff0000u),
                                              __uint_as_float(w[1] << 16), __uint_as_float(w[1] & 0xffff0000u));
            ((float4*)y)[2 * i + 1] = make_float4(__uint_as_float(w[2] << 16), __uint_as_float(w[2] & 0xffff0000u),
                                                  __uint_as_float(w[3] << 16), __uint_as_float(w[3] & 0xffff0000u));
        }
    }
    for (long long i = 8 * n8 + start; i < n; i += stride) {
        bf16_t v = x[i];
        if ((v & 0x7f80u) == 0x7f80u) {
            count++;
            first = min(first, (unsigned long long)i);
            v = 0;
        }
        x_bf[i] = v;
        if (y) y[i] = bf16_to_f32(v);
    }
    add_count(count, first, result);
}

// Hands the layer's output out: y = x, as f32 or with `bf16` rounded to the nearest bf16 (as
// f32_to_bf16 rounds), and unless `result` is null the NaN and infinite values of x counted into
// it as nonfinite_pass counts them, in the same pass. Eight values a step (two 16-byte loads,
// one or two 16-byte stores) when both are 16-byte aligned, then the rest one by one. Any grid
// of whole warps.
__global__ void copy_counting_nonfinite(const float* __restrict__ x, void* __restrict__ y, int bf16, long long n,
                                        unsigned long long* result) {
    unsigned long long count = 0, first = ~0ull;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    const long long n8 = (((u64)x | (u64)y) & 15) == 0 ? n / 8 : 0;
    for (long long i = start; i < n8; i += stride) {
        const float4 a = ((const float4*)x)[2 * i], b = ((const float4*)x)[2 * i + 1];
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if ((__float_as_uint(v[j]) & 0x7f800000u) == 0x7f800000u) {
                count++;
                first = min(first, (unsigned long long)(8 * i + j));
            }
        }
        if (bf16) {
            unsigned o[4];
#pragma unroll
            for (int j = 0; j < 4; j++) o[j] = (unsigned)f32_to_bf16(v[2 * j]) | ((unsigned)f32_to_bf16(v[2 * j + 1]) << 16);
            ((uint4*)y)[i] = make_uint4(o[0], o[1], o[2], o[3]);
        } else {
            ((float4*)y)[2 * i] = a;
            ((float4*)y)[2 * i + 1] = b;
        }
    }
    for (long long i = 8 * n8 + start; i < n; i += stride) {
        const float v = x[i];
        if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {
            count++;
            first = min(first, (unsigned long long)i);
        }
        if (bf16) {
            ((bf16_t*)y)[i] = f32_to_bf16(v);
        } else {
            ((float*)y)[i] = v;
        }
    }
    if (result) add_count(count, first, result);
}

// Moves one call's count of non-finite values of x (call = {count, first index}, as a kernel
// above left it; x as it was before a clear: f32 values, or bf16 ones when `bf16`) into a
// running record {count, latest first index, that value's f32 bits}: adds the count and, when
// the call found any, records where the first was and its value; then resets call to {0, ~0}
// for the next call. One thread; stream-ordered after the count, so a CUDA graph replays it as
// it replays the count.
__global__ void latch_nonfinite(const void* __restrict__ x, int bf16, unsigned long long* call,
                                unsigned long long* record) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long count = call[0];
    if (count > 0) {
        record[0] += count;
        record[1] = call[1];
        const float v = bf16 ? bf16_to_f32(((const bf16_t*)x)[call[1]]) : ((const float*)x)[call[1]];
        record[2] = (unsigned long long)__float_as_uint(v);
    }
    call[0] = 0;
    call[1] = ~0ull;
}

}  // extern "C"
