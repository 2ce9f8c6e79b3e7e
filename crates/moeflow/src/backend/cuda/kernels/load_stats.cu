// Expert load statistics on the device: per forward call, the (token, slot) pairs routed to each
// logical expert, written into a ring of `window` rows without a host round trip.

extern "C" {

// One block. Counts ids[0, n) (logical expert ids of a call's top-k; with `live`, only the first
// *live · k of them: a low-latency layer's batch inside its capacity) into shared bins, writes
// the E bins into row (*calls mod window) of window_rows [window, E] and advances *calls. The
// row comes from device memory, so a captured CUDA graph replays into the next row each time.
// Needs E unsigned ints of dynamic shared memory.
__global__ void count_expert_load(const int* __restrict__ ids, int n, const int* live, int k, int num_experts,
                                  unsigned int* window_rows, int window, unsigned long long* calls) {
    extern __shared__ unsigned int bins[];
    if (live != nullptr) n = min(n, *live * k);
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) bins[e] = 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int e = ids[i];
        if (e >= 0 && e < num_experts) atomicAdd(&bins[e], 1u);
    }
    __syncthreads();
    unsigned long long call = *calls;
    unsigned int* row = window_rows + (call % (unsigned long long)window) * (unsigned long long)num_experts;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) row[e] = bins[e];
    __syncthreads();
    if (threadIdx.x == 0) *calls = call + 1;
}

}  // extern "C"
