// The permute: the slots sorted by expert (a deterministic counting sort giving each slot its
// row, an expert's rows in slot order), rows copied to their places, and the slots an
// expert-parallel rank serves listed in order. (Compiled after common.cu.)

extern "C" {

// A counting sort of the slots by expert, deterministic: the slots go in chunks of SORT_CHUNK,
// one block of SORT_THREADS threads a chunk and SORT_CHUNK / SORT_WARPS slots a warp of it, in
// two kernels: count_chunks counts each chunk's slots per expert, then scatter_chunks gives each
// slot its row, an expert's rows in slot order (chunks in order, a chunk's warps in order, a
// warp's lanes in order). Each reads the ids once. A single chunk goes in one launch of
// scatter_chunks, which counts it too.
#define SORT_CHUNK 1024
#define SORT_THREADS 256
#define SORT_WARPS (SORT_THREADS / 32)
#define SORT_STEPS (SORT_CHUNK / SORT_THREADS)  // 32-slot steps a warp

// This warp's SORT_STEPS steps of ids of chunk `chunk` (-1 past the slots): lane l of step u
// holds slot base + 32 u + l, base the warp's first slot (returned).
__device__ __forceinline__ int sort_load(const int* ids, int slots, int chunk, int* v) {
    const int base = chunk * SORT_CHUNK + (threadIdx.x / 32) * (SORT_CHUNK / SORT_WARPS);
#pragma unroll
    for (int u = 0; u < SORT_STEPS; u++) {
        const int s = base + 32 * u + threadIdx.x % 32;
        v[u] = s < slots ? ids[s] : -1;
    }
    return base;
}

// hist[c E + e] = the slots of chunk c naming expert e, and counts[e] = the slots naming e over
// every chunk; ids outside 0 .. E (no expert of these) are not counted. One block per chunk;
// the last block to finish (a counter in `ticket`, zero between launches: it sets it back)
// adds the chunks' counts in chunk order, so no memset of counts comes before. Dynamic shared
// memory: E ints.
__global__ void __launch_bounds__(SORT_THREADS)
    count_chunks(const int* ids, int slots, int E, int* hist, int* counts, int* ticket) {
    extern __shared__ int sort_smem[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) sort_smem[e] = 0;
    __syncthreads();
    int v[SORT_STEPS];
    sort_load(ids, slots, blockIdx.x, v);
#pragma unroll
    for (int u = 0; u < SORT_STEPS; u++) {
        // The lanes naming one expert add once, by the lowest of them.
        const unsigned peers = __match_any_sync(0xffffffffu, v[u]);
        if (v[u] >= 0 && v[u] < E && threadIdx.x % 32 == __ffs(peers) - 1) atomicAdd(&sort_smem[v[u]], __popc(peers));
    }
    __syncthreads();
    if (gridDim.x == 1) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = counts[e] = sort_smem[e];
        return;
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[(long)blockIdx.x * E + e] = sort_smem[e];
    if (!last_block_here(ticket)) return;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int sum = 0;
#pragma unroll 8
        for (int c = 0; c < (int)gridDim.x; c++) sum += __ldcg(&hist[(long)c * E + e]);
        counts[e] = sum;
    }
    if (threadIdx.x == 0) *ticket = 0;
}

// The rows of chunk blockIdx.x's slots (hist and counts from count_chunks over the same ids;
// with hist null, one block over at most SORT_CHUNK slots and no count pass: it counts them
// itself and writes counts): expert e's rows start at offsets[e] = the slots naming experts
// before e (cap = 0), or e · cap (padded: every expert owns cap rows), and offsets[E] = the
// total, written by block 0; within them, its slots in slot order. row_of_slot[s] = the row,
// slot_of_row[row] = s and expert_of_row[row] = e; slots of expert `skip` (an expert-parallel
// rank's "held elsewhere" bucket) get row -1 and no row; slots naming no expert of these are
// left alone. Dynamic shared memory: (SORT_WARPS + 1) E ints.
__global__ void __launch_bounds__(SORT_THREADS)
    scatter_chunks(const int* ids, int slots, int E, const int* hist, int* counts, int cap, int skip, int* offsets,
                   int* row_of_slot, int* slot_of_row, int* expert_of_row) {
    extern __shared__ int sort_smem[];
    __shared__ int warp_sums[SORT_WARPS];
    int* next = sort_smem + E;  // [SORT_WARPS][E]: each warp's next row of each expert
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, chunk = blockIdx.x;
    int v[SORT_STEPS];
    const int base = sort_load(ids, slots, chunk, v);
    for (int i = threadIdx.x; i < SORT_WARPS * E; i += blockDim.x) next[i] = 0;
    __syncthreads();
    // Each warp counts its slots per expert (the lowest lane of those naming one adds).
    int* mine_next = next + w * E;
#pragma unroll
    for (int u = 0; u < SORT_STEPS; u++) {
        const unsigned peers = __match_any_sync(0xffffffffu, v[u]);
        if (v[u] >= 0 && v[u] < E && lane == __ffs(peers) - 1) mine_next[v[u]] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // Without a count pass the warps' counts add up to the experts' counts.
    if (hist == nullptr) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            int c = 0;
            for (int j = 0; j < SORT_WARPS; j++) c += next[j * E + e];
            counts[e] = c;
        }
        __syncthreads();
    }
    // Each thread takes `per` experts in a row: their counts' exclusive sum over the block gives
    // the experts' offsets, and hist's earlier chunks where this chunk's rows of each start.
    const int per = (E + SORT_THREADS - 1) / SORT_THREADS;
    const int e_lo = min(E, (int)threadIdx.x * per), e_hi = min(E, e_lo + per);
    int mine = 0;
    for (int e = e_lo; e < e_hi; e++) mine += counts[e];
    int incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sums[w] = incl;
    __syncthreads();
    int before = incl - mine;
    for (int i = 0; i < w; i++) before += warp_sums[i];
    for (int e = e_lo; e < e_hi; e++) {
        int earlier = 0;
#pragma unroll 8
        for (int c = 0; c < chunk; c++) earlier += hist[(long)c * E + e];
        const int offset = cap > 0 ? e * cap : before;
        sort_smem[e] = offset + earlier;
        if (chunk == 0) offsets[e] = offset;
        before += counts[e];
    }
    // The last thread's range ends at E: `before` is the total.
    if (chunk == 0 && threadIdx.x == blockDim.x - 1) offsets[E] = cap > 0 ? E * cap : before;
    __syncthreads();
    // The warps' counts become each warp's first row of each expert: the chunk's start, then
    // the warps before it...
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = sort_smem[e];
        for (int j = 0; j < SORT_WARPS; j++) {
            const int n = next[j * E + e];
            next[j * E + e] = run;
            run += n;
        }
    }
    __syncthreads();
    // ...and each slot's row that, plus the lanes before it naming the same expert.
#pragma unroll
    for (int u = 0; u < SORT_STEPS; u++) {
        const int s = base + 32 * u + lane, e = v[u];
        const bool here = e >= 0 && e < E;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        if (here && e == skip) {
            row_of_slot[s] = -1;
        } else if (here) {
            const int r = mine_next[e] + __popc(peers & ((1u << lane) - 1u));
            row_of_slot[s] = r;
            slot_of_row[r] = s;
            expert_of_row[r] = e;
        }
        __syncwarp();
        if (here && lane == __ffs(peers) - 1) mine_next[e] += __popc(peers);
        __syncwarp();
    }
}

// One bf16 row of H values from src to dst by the threads of a block, 16-byte moves when
// H % 8 == 0 (rows then start 16-byte aligned).
__device__ __forceinline__ void copy_row(const bf16_t* src, bf16_t* dst, int H) {
    if (H % 8 == 0) {
        const uint4* s4 = (const uint4*)src;
        uint4* d4 = (uint4*)dst;
        for (int h = threadIdx.x; h < H / 8; h += blockDim.x) d4[h] = s4[h];
    } else {
        for (int h = threadIdx.x; h < H; h += blockDim.x) dst[h] = src[h];
    }
}

// a[row_of_slot[s], :] = x[s / k, :] (bf16 rows); one block per slot. Rows no slot maps to
// (padding) are left as they are; slots with row -1 skipped.
__global__ void gather_rows(const bf16_t* x, int H, const int* row_of_slot, int k, int slots, bf16_t* a) {
    int s = blockIdx.x;
    if (s >= slots) return;
    if (row_of_slot[s] < 0) return;
    copy_row(x + (long)(s / k) * H, a + (long)row_of_slot[s] * H, H);
}

// The rows of a gathered fp8 operand laid out in expert order: for each row r of the experts'
// (r below offsets[experts - 1] + counts[experts - 1]; the rest of the `rows` blocks return),
// codes[r, :] = x[t, :] (H codes, H % 16 == 0) and scales[r, :] = xs[t, :] (G floats), t =
// slot_of_row[r] / k. One block per row.
__global__ void gather_fp8_rows(const unsigned char* x, const float* xs, int H, int G, const int* slot_of_row, int k,
                                const int* counts, const int* offsets, int experts, int rows, unsigned char* codes,
                                float* scales) {
    const int r = blockIdx.x;
    if (r >= rows || r >= offsets[experts - 1] + counts[experts - 1]) return;
    const long t = slot_of_row[r] / k;
    const uint4* from = (const uint4*)(x + t * H);
    uint4* to = (uint4*)(codes + (long)r * H);
    for (int h = threadIdx.x; h < H / 16; h += blockDim.x) to[h] = from[h];
    for (int g = threadIdx.x; g < G; g += blockDim.x) scales[(long)r * G + g] = xs[t * G + g];
}

// dst[j, :] = src[idx[j], :] for j < n (bf16 rows); one block per row.
__global__ void take_rows(const bf16_t* src, const int* idx, int n, int H, bf16_t* dst) {
    int j = blockIdx.x;
    if (j >= n) return;
    copy_row(src + (long)idx[j] * H, dst + (long)j * H, H);
}

// One block: idx[p] = row_of_slot[i] for the p-th slot i (in order) of the n that this rank
// serves (local_ids[i] < el), so that take_rows gathers the served slots' rows in slot order.
__global__ void compact_served(const int* local_ids, const int* row_of_slot, int n, int el, int* idx) {
    __shared__ int warp_base[32];
    __shared__ int base;
    int lane = threadIdx.x % 32, w = threadIdx.x / 32, warps = blockDim.x / 32;
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (int start = 0; start < n; start += blockDim.x) {
        int i = start + threadIdx.x;
        bool served = i < n && local_ids[i] < el;
        unsigned mask = __ballot_sync(0xffffffffu, served);
        if (lane == 0) warp_base[w] = __popc(mask);
        __syncthreads();
        if (threadIdx.x == 0) {
            int acc = base;
            for (int q = 0; q < warps; q++) {
                int c = warp_base[q];
                warp_base[q] = acc;
                acc += c;
            }
            base = acc;
        }
        __syncthreads();
        if (served) idx[warp_base[w] + __popc(mask & ((1u << lane) - 1))] = row_of_slot[i];
        __syncthreads();
    }
}

}  // extern "C"
