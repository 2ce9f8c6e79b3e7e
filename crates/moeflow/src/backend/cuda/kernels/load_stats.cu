// Expert load statistics on the device: per forward call, the (token, slot) pairs routed to each
// logical expert, written into a ring of `window` rows without a host round trip.

extern "C" {

// One block. Counts ids[0, n) (logical expert ids of a call's top-k; with `live`, only the first
// *live · k of them: a low-latency layer's batch inside its capacity) into shared bins, writes
// the E bins into row (*calls mod window) of window_rows [window, E] and advances *calls. The
// row comes from device memory, so a captured CUDA graph replays into the next row each time.
// A thread loads up to eight 16-byte words of ids before counting them (where the ids are
// 16-byte aligned), so that the loads wait on memory together. Needs E unsigned ints of dynamic
// shared memory.
__device__ __forceinline__ void count_expert(unsigned int* bins, int e, int num_experts) {
    if (e >= 0 && e < num_experts) atomicAdd(&bins[e], 1u);
}
__global__ void count_expert_load(const int* __restrict__ ids, int n, const int* live, int k, int num_experts,
                                  unsigned int* window_rows, int window, unsigned long long* calls) {
    extern __shared__ unsigned int bins[];
    if (live != nullptr) n = min(n, *live * k);
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) bins[e] = 0u;
    __syncthreads();
    const int words = ((unsigned long long)ids & 15) == 0 ? n / 4 : 0;
    const int4* ids4 = (const int4*)ids;
    for (int i0 = threadIdx.x; i0 < words; i0 += 8 * blockDim.x) {
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (i0 + u * (int)blockDim.x < words) v[u] = ids4[i0 + u * blockDim.x];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            if (i0 + u * (int)blockDim.x >= words) break;
            count_expert(bins, v[u].x, num_experts);
            count_expert(bins, v[u].y, num_experts);
            count_expert(bins, v[u].z, num_experts);
            count_expert(bins, v[u].w, num_experts);
        }
    }
    for (int i = 4 * words + threadIdx.x; i < n; i += blockDim.x) count_expert(bins, ids[i], num_experts);
    __syncthreads();
    unsigned long long call = *calls;
    unsigned int* row = window_rows + (call % (unsigned long long)window) * (unsigned long long)num_experts;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) row[e] = bins[e];
    __syncthreads();
    if (threadIdx.x == 0) *calls = call + 1;
}

}  // extern "C"
