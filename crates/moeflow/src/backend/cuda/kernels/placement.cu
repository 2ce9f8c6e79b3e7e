// Expert placement on the ranks: global expert ids to a rank's local slots, with replicated
// experts sharing a batch's tokens (placement.rs describes the rule). (Compiled after common.cu.)

extern "C" {

// Global expert ids to this rank's local ids: `first..first + el` → `0..el`, others → el.
__global__ void localize_ids(const int* ids, int n, int first, int el, int* out) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int l = ids[i] - first;
        out[i] = (l >= 0 && l < el) ? l : el;
    }
}

// The physical replica serving slot j of token t routed to logical expert e (see placement.rs):
// rep_first[e] + (t + j) mod rep_count[e] where the expert's replicas share the batch (every
// expert when `shared` is null, else where shared[e] is nonzero), its first replica rep_first[e]
// elsewhere; it lives on rank rep_rank[p] in local slot rep_slot[p].
__device__ __forceinline__ int placed_replica(const int* rep_first, const int* rep_count, const int* shared, int e,
                                              int t, int j) {
    return rep_first[e] + ((shared == nullptr || shared[e]) ? (t + j) % rep_count[e] : 0);
}

// shared[e] = 1 where logical expert e has several replicas and the `*tokens` tokens' ids
// ([*tokens, k], -1 for none) name it at least `least` times, else 0 (see
// ExpertPlacement::shared_replicas). One block; the experts are counted in shared memory,
// `chunk` of them at a time.
__global__ void replica_shares(const int* ids, const int* tokens, int k, int E, const int* rep_count, int least,
                               int* shared) {
    extern __shared__ int pairs[];
    const int chunk = 4096;
    int n = *tokens * k;
    for (int base = 0; base < E; base += chunk) {
        int width = min(chunk, E - base);
        for (int e = threadIdx.x; e < width; e += blockDim.x) pairs[e] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            int e = ids[i] - base;
            if (e >= 0 && e < width) atomicAdd(&pairs[e], 1);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < width; e += blockDim.x)
            shared[base + e] = rep_count[base + e] > 1 && pairs[e] >= least;
        __syncthreads();
    }
}

// out[i] = the local slot on `rank` that serves slot i of `ids` ([n / k rows, k], row r being
// token r mod `period` of rank r / period's batch), or el when another rank serves it or the id
// is -1. `shared` ([ranks, E], or null for every expert shared) says whose replicas share each
// rank's batch.
__global__ void localize_placed(const int* ids, int n, int k, int period, const int* rep_first,
                                const int* rep_count, const int* rep_rank, const int* rep_slot, const int* shared,
                                int E, int rank, int el, int* out) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int e = ids[i];
        int l = el;
        if (e >= 0) {
            int row = i / k;
            const int* sh = shared == nullptr ? nullptr : shared + (long)(row / period) * E;
            int p = placed_replica(rep_first, rep_count, sh, e, row % period, i % k);
            if (rep_rank[p] == rank) l = rep_slot[p];
        }
        out[i] = l;
    }
}

}  // extern "C"
