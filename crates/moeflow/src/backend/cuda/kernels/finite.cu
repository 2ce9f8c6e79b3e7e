// Non-finite values of a device buffer, found in one pass.

extern "C" {

// Counts the NaN and infinite values of x[0, n) and finds the first one's index: adds the count
// to result[0] and lowers result[1] to the index (result starts as {0, ~0}); with `clear`, sets
// each of them to 0. Any grid of whole warps; each warp adds its share with one atomic of each
// kind.
__device__ void nonfinite_pass(float* x, long long n, unsigned long long* result, bool clear) {
    unsigned long long count = 0, first = ~0ull;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        // All exponent bits set: infinity or NaN.
        if ((__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u) {
            count++;
            if ((unsigned long long)i < first) first = (unsigned long long)i;
            if (clear) x[i] = 0.0f;
        }
    }
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

// The count of nonfinite_pass, x left as it is.
__global__ void count_nonfinite_f32(const float* __restrict__ x, long long n, unsigned long long* result) {
    nonfinite_pass(const_cast<float*>(x), n, result, false);
}

// The count of nonfinite_pass, each NaN or infinite value of x set to 0, so that the work after
// it (routing, whose choices index memory) never meets one.
__global__ void clear_nonfinite_f32(float* x, long long n, unsigned long long* result) {
    nonfinite_pass(x, n, result, true);
}

// Moves one call's count of non-finite values of x (call = {count, first index}, as
// count_nonfinite_f32 or clear_nonfinite_f32 left it; x as it was before a clear) into a running
// record {count, latest first index, that value's bits}: adds the count and, when the call
// found any, records where the first was and its value; then resets call to {0, ~0} for the
// next call. One thread; stream-ordered after the count, so a CUDA graph replays it as it
// replays the count.
__global__ void latch_nonfinite_f32(const float* __restrict__ x, unsigned long long* call,
                                    unsigned long long* record) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long count = call[0];
    if (count > 0) {
        record[0] += count;
        record[1] = call[1];
        record[2] = (unsigned long long)__float_as_uint(x[call[1]]);
    }
    call[0] = 0;
    call[1] = ~0ull;
}

}  // extern "C"
