// moeflow CUDA kernels: routing, permute, activation, combine, conversions.
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

// Deterministic uniform values in [-scale, scale) from (seed, index): for large benchmarks.
__global__ void fill_uniform_bf16(bf16_t* y, long n, u64 seed, float scale) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        u64 z = seed + 0x9E3779B97F4A7C15ull * (u64)(i + 1);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) / 16777216.0f;
        y[i] = f32_to_bf16((2.0f * u - 1.0f) * scale);
    }
}

// *at = the GPU's global nanosecond clock: a stage boundary inside a CUDA graph, where events
// are not timed. One thread.
__global__ void stamp_clock(u64* at) {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *at = now;
}

__global__ void fill_uniform_f32(float* y, long n, u64 seed, float scale) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        u64 z = seed + 0x9E3779B97F4A7C15ull * (u64)(i + 1);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        y[i] = (2.0f * ((float)(z >> 40) / 16777216.0f) - 1.0f) * scale;
    }
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

// Router kinds: 0 softmax top-k, 1 top-k then softmax, 2 sigmoid + bias grouped (DeepSeek-V3),
// 3 softmax group-limited (DeepSeek-V2). One warp per token, choice scores in shared memory;
// ties go to the lower id. E <= MAX_E, k <= MAX_K, n_group <= 64.
//
// Groups are chosen by rank (an entry's rank counts the entries above it, equal ones at lower
// ids counting as above: a few independent comparisons for a handful of groups). Experts are
// chosen in k rounds of warp argmax over ordered integer keys: each lane holds the keys of
// experts lane, lane + 32, ..., its best untaken one a few comparisons away in registers, and
// a round is two warp reductions (`redux.sync`: the largest key, then the lowest id holding
// it), where ranking every candidate against every other cost n² / 32 comparisons a lane
// (docs/tuning.md).
#define MAX_K 32
#define MAX_E 1024
#define WARPS 4

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The warp's largest (MAX) or smallest value of v, in every lane: one redux.sync (the module
// needs sm_80 anyway, for cp.async).
template <bool MAX, typename T>
__device__ __forceinline__ T warp_reduce(T v) {
    if constexpr (MAX) return __reduce_max_sync(0xffffffffu, v);
    else return __reduce_min_sync(0xffffffffu, v);
}

// Whether score u of id f ranks above score v of id e.
__device__ __forceinline__ bool ranks_above(float u, int f, float v, int e) { return u > v || (u == v && f < e); }

// A choice score as an integer key in the same order: equal scores (+0 and -0 too) give equal
// keys; 0, below every other key, for no candidate (-inf or NaN).
__device__ __forceinline__ unsigned score_key(float v) {
    if (!(v > -INFINITY)) return 0u;
    const unsigned b = __float_as_uint(v == 0.0f ? 0.0f : v);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// One token's choice by one warp: its k ids and weights into ids[0 .. k) and weights[0 .. k)
// from its E logits l (and the E bias values of kind 2); s and gs are the warp's shared scratch
// of MAX_E scores and 64 group scores. PER: experts a lane holds, E <= 32 · PER.
template <int PER>
__device__ void route_token(const float* l, const float* bias, int E, int k, int kind, int n_group, int topk_group,
                            int renorm, float scaling, int* ids, float* weights, float* s, float* gs) {
    int lane = threadIdx.x % 32;
    const bool softmax = kind == 0 || kind == 3;
    // This lane's logits (of experts lane + 32 q), all loads in flight together, then their
    // choice scores in place (written to s for the groups' scan).
    float v[PER];
#pragma unroll
    for (int q = 0; q < PER; q++) {
        const int e = lane + 32 * q;
        v[q] = e < E ? l[e] : 0.0f;
    }
    float mx = -INFINITY, sum = 0.0f;
    if (softmax) {
#pragma unroll
        for (int q = 0; q < PER; q++)
            if (lane + 32 * q < E) mx = fmaxf(mx, v[q]);
        mx = warp_max(mx);
#pragma unroll
        for (int q = 0; q < PER; q++)
            if (lane + 32 * q < E) sum += __expf(v[q] - mx);
        sum = warp_sum(sum);
    }
#pragma unroll
    for (int q = 0; q < PER; q++) {
        const int e = lane + 32 * q;
        if (softmax) v[q] = __expf(v[q] - mx) / sum;
        else if (kind == 2) v[q] = 1.0f / (1.0f + __expf(-v[q])) + (bias && e < E ? bias[e] : 0.0f);
        if (n_group > 1 && e < E) s[e] = v[q];
    }
    unsigned long long keep = ~0ull;  // the groups kept (all without groups)
    const int group_size = n_group > 1 ? E / n_group : E;
    if (n_group > 1) {
        __syncwarp();
        // Group scores (the best, or with kind 2 the best two, of each group's experts), then
        // the topk_group best groups kept: lane g ranks groups g and g + 32. Each group is
        // scanned by `lpg` lanes (a power of two, up to 32 / n_group), each taking every lpg-th
        // expert, their best two merged by shuffles (the best two of a union are the larger
        // best and the largest of the rest, so the scores are those of one serial scan).
        int lpg = 1;
        while (lpg * 2 * n_group <= 32) lpg *= 2;
        for (int g0 = 0; g0 < n_group; g0 += 32 / lpg) {
            int g = g0 + lane / lpg, sub = lane % lpg;
            float a = -INFINITY, b = -INFINITY;
            if (g < n_group)
                for (int e = g * group_size + sub; e < (g + 1) * group_size; e += lpg) {
                    float v = s[e];
                    if (v > a) { b = a; a = v; } else if (v > b) { b = v; }
                }
            for (int o = 1; o < lpg; o <<= 1) {
                float a2 = __shfl_xor_sync(0xffffffffu, a, o), b2 = __shfl_xor_sync(0xffffffffu, b, o);
                b = fmaxf(fminf(a, a2), fmaxf(b, b2));
                a = fmaxf(a, a2);
            }
            if (g < n_group && sub == 0) gs[g] = kind == 2 ? a + b : a;
        }
        __syncwarp();
        keep = 0;
        for (int q = 0; q < 2; q++) {
            int g = lane + 32 * q, r = 0;
            if (g < n_group)
                for (int h = 0; h < n_group; h++) r += ranks_above(gs[h], h, gs[g], g);
            unsigned kept = __ballot_sync(0xffffffffu, g < n_group && r < topk_group);
            keep |= (unsigned long long)kept << (32 * q);
        }
    }
    // This lane's keys: expert lane + 32 q in key[q], 0 where it is no candidate (past E, in a
    // group not kept, or a score of -inf or NaN).
    unsigned key[PER];
#pragma unroll
    for (int q = 0; q < PER; q++) {
        const int e = lane + 32 * q;
        key[q] = e < E && (keep >> (e / group_size) & 1ull) ? score_key(v[q]) : 0u;
    }
    // Round r: every lane offers its best untaken key (the lower id of equal ones: the first
    // q), the warp takes the largest, and of the lanes offering it the lowest id; lane r keeps
    // that id, its lane marks it taken. A largest key of 0 means no candidate is left.
    int chosen = -1;  // lane j < k holds choice j
    unsigned taken = 0;
    for (int r = 0; r < k; r++) {
        unsigned best = 0;
        int at = 0;
#pragma unroll
        for (int q = 0; q < PER; q++) {
            const bool better = !(taken >> q & 1u) && key[q] > best;
            best = better ? key[q] : best;
            at = better ? q : at;
        }
        const unsigned top = warp_reduce<true>(best);
        if (top == 0) break;
        const int id = best == top ? lane + 32 * at : 0x7fffffff;
        const int won = warp_reduce<false>(id);
        if (lane == r) chosen = won;
        if (id == won) taken |= 1u << at;
    }
    bool mine = lane < k && chosen >= 0;
    float w = 0.0f;
    if (mine) {
        if (kind == 1) w = l[chosen];
        else if (kind == 2) w = 1.0f / (1.0f + __expf(-l[chosen]));
        else w = __expf(l[chosen] - mx) / sum;
    }
    if (kind == 1) {
        float m = warp_max(mine ? w : -INFINITY);
        w = mine ? __expf(w - m) : 0.0f;
    }
    float total = warp_sum(mine ? w : 0.0f);
    if (kind == 1) w /= total;
    else if (kind == 0) { if (renorm) w /= total; }
    else if (kind == 2) { if (renorm && k > 1) w /= (total + 1e-20f); w *= scaling; }
    else { if (renorm && k > 1) w /= (total + 1e-20f); else w *= scaling; }
    if (lane < k) {
        ids[lane] = chosen;
        weights[lane] = w;
    }
}

// Top-k of every token (a warp each), or of the first *live when `live` is not null: route and
// route_wide below.
template <int PER>
__device__ __forceinline__ void route_rows(const float* logits, const float* bias, int T, int E, int k, int kind,
                                           int n_group, int topk_group, int renorm, float scaling, const int* live,
                                           int* ids, float* weights) {
    __shared__ float sc[WARPS][32 * PER];
    __shared__ float group_score[WARPS][64];
    int warp = threadIdx.x / 32;
    int t = blockIdx.x * WARPS + warp;
    if (t >= T || (live && t >= *live)) return;
    route_token<PER>(logits + (long)t * E, bias, E, k, kind, n_group, topk_group, renorm, scaling, ids + (long)t * k,
                     weights + (long)t * k, sc[warp], group_score[warp]);
}

extern "C" {

// route_rows for up to ROUTE_EXPERTS experts (every preset), and for up to MAX_E: a kernel each,
// since the wider one's keys take registers the narrow one would lose warps to.
#define ROUTE_EXPERTS 256
__global__ void route(const float* logits, const float* bias, int T, int E, int k, int kind, int n_group, int topk_group,
                      int renorm, float scaling, const int* live, int* ids, float* weights) {
    route_rows<ROUTE_EXPERTS / 32>(logits, bias, T, E, k, kind, n_group, topk_group, renorm, scaling, live, ids,
                                   weights);
}
__global__ void route_wide(const float* logits, const float* bias, int T, int E, int k, int kind, int n_group,
                           int topk_group, int renorm, float scaling, const int* live, int* ids, float* weights) {
    route_rows<MAX_E / 32>(logits, bias, T, E, k, kind, n_group, topk_group, renorm, scaling, live, ids, weights);
}

// The whole routing of up to ROUTE_SMALL_TOKENS tokens in one launch, for small batches on one
// GPU, in place of the bf16 copy, the router GEMM, the bias, route and the counting sort
// (count_chunks, scatter_chunks); launched with 256 threads a block and one block per
// ROUTE_SMALL_COLS columns.
// Block b takes columns 128 b .. 128 b + 127 of x [T, H]: it writes their bf16 copy to x_bf
// and, for every token and expert, the partial dot product over them (a lane's four products
// in column order, then a warp's fixed tree) to partials [blocks, ROUTE_SMALL_TOKENS, E]. The
// last block to finish (a counter in `done`, which it sets back to 0) adds the partials in a
// fixed order, plus gate_bias (null: none), into logits [T, E]; chooses each token's experts as
// route does (corr_bias: kind 2's bias); and writes counts [E], offsets [E + 1] and the slot/row
// maps as scatter_chunks does with cap 0: the rows of an expert in slot order. A token's logits
// are the same bits whatever the batch's size up to ROUTE_SMALL_TOKENS. E <= ROUTE_SMALL_EXPERTS
// (FUSED_ROUTE_EXPERTS in route.rs): its choice holds four keys a lane, a short stretch of code
// that its one routing block runs cold at every launch.
#define ROUTE_SMALL_TOKENS 4
#define ROUTE_SMALL_EXPERTS 128
#define ROUTE_SMALL_COLS 128
__global__ void route_small(const float* x, const float* gate, const float* gate_bias, const float* corr_bias, int T,
                            int H, int E, int k, int kind, int n_group, int topk_group, int renorm, float scaling,
                            float* partials, int* done, bf16_t* x_bf, float* logits, int* ids, float* weights,
                            int* counts, int* offsets, int* row_of_slot, int* slot_of_row, int* expert_of_row) {
    __shared__ float xs[ROUTE_SMALL_TOKENS][ROUTE_SMALL_COLS];
    __shared__ float sc[ROUTE_SMALL_TOKENS][MAX_E];
    __shared__ float group_score[ROUTE_SMALL_TOKENS][64];
    __shared__ int sid[ROUTE_SMALL_TOKENS * MAX_K];
    __shared__ bool last;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int c0 = blockIdx.x * ROUTE_SMALL_COLS;
    for (int i = threadIdx.x; i < T * ROUTE_SMALL_COLS; i += blockDim.x) {
        const int t = i / ROUTE_SMALL_COLS, c = c0 + i % ROUTE_SMALL_COLS;
        const float v = c < H ? x[(long)t * H + c] : 0.0f;
        xs[t][i % ROUTE_SMALL_COLS] = v;
        if (c < H) x_bf[(long)t * H + c] = f32_to_bf16(v);
    }
    __syncthreads();
    // Warp w takes experts w, w + warps, ...: eight at a time, their gate values loaded first
    // so the loads wait on memory together.
    const int ca = c0 + 4 * lane;
    for (int e0 = warp; e0 < E; e0 += 8 * warps) {
        float g[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int e = e0 + j * warps;
            const float* row = gate + (long)e * H;
#pragma unroll
            for (int q = 0; q < 4; q++) g[j][q] = e < E && ca + q < H ? row[ca + q] : 0.0f;
        }
        for (int t = 0; t < T; t++) {
            const float* xt = xs[t] + 4 * lane;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int e = e0 + j * warps;
                if (e >= E) break;
                float p = xt[0] * g[j][0];
#pragma unroll
                for (int q = 1; q < 4; q++) p = fmaf(xt[q], g[j][q], p);
                p = warp_sum(p);
                if (lane == 0) partials[((long)blockIdx.x * ROUTE_SMALL_TOKENS + t) * E + e] = p;
            }
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Each logit: four threads sum a quarter of the blocks' partials each, in block order, and
    // the quarters are added in order (a fixed order for a given H, whatever T). A thread takes
    // every 64th logit of a chunk of MAX_E, its loads issued sixteen at a time, and the
    // quarters wait in sc until the whole chunk is summed.
    const int blocks = gridDim.x, span = (blocks + 3) / 4, per = blockDim.x / 4;
    const int part = threadIdx.x / per, lo = part * span, hi = min(blocks, lo + span);
    for (int base = 0; base < T * E; base += MAX_E) {
        const int m = min(MAX_E, T * E - base);
        for (int j = threadIdx.x % per; j < m; j += per) {
            const float* col = partials + base + j;
            float v = 0.0f;
            for (int b0 = lo; b0 < hi; b0 += 16) {
                float q[16];
#pragma unroll
                for (int u = 0; u < 16; u++)
                    q[u] = b0 + u < hi ? __ldcg(col + (long)(b0 + u) * ROUTE_SMALL_TOKENS * E) : 0.0f;
#pragma unroll
                for (int u = 0; u < 16; u++)
                    if (b0 + u < hi) v += q[u];
            }
            sc[part][j] = v;
        }
        __syncthreads();
        for (int j = threadIdx.x; j < m; j += blockDim.x) {
            float l = ((sc[0][j] + sc[1][j]) + sc[2][j]) + sc[3][j];
            if (gate_bias) l += gate_bias[(base + j) % E];
            logits[base + j] = l;
        }
        __syncthreads();
    }
    if (warp < T)
        route_token<ROUTE_SMALL_EXPERTS / 32>(logits + (long)warp * E, corr_bias, E, k, kind, n_group, topk_group,
                                              renorm, scaling, ids + (long)warp * k, weights + (long)warp * k,
                                              sc[warp], group_score[warp]);
    __syncthreads();
    const int slots = T * k;
    for (int s = threadIdx.x; s < slots; s += blockDim.x) sid[s] = ids[s];
    __syncthreads();
    // At most 128 slots: an expert's offset counts the slots of lower ids, a slot's row adds the
    // earlier slots of its own expert.
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        int before = 0, here = 0;
        for (int s = 0; s < slots; s++) {
            before += sid[s] < e;
            here += sid[s] == e;
        }
        offsets[e] = before;
        if (e < E) counts[e] = here;
    }
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        const int e = sid[s];
        int r = 0;
        for (int j = 0; j < slots; j++) r += sid[j] < e || (sid[j] == e && j < s);
        row_of_slot[s] = r;
        slot_of_row[r] = s;
        expert_of_row[r] = e;
    }
    if (threadIdx.x == 0) *done = 0;
}

// A counting sort of the slots by expert, deterministic: the slots go in chunks of SORT_CHUNK,
// one block of SORT_THREADS threads a chunk and SORT_CHUNK / SORT_WARPS slots a warp of it, in
// two kernels: count_chunks counts each chunk's slots per expert, then scatter_chunks gives each
// slot its row, an expert's rows in slot order (chunks in order, a chunk's warps in order, a
// warp's lanes in order). Each reads the ids once.
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

// hist[c E + e] = the slots of chunk c naming expert e, and counts[e] += it (counts zeroed by the
// caller, so that it ends as the slots naming e); ids outside 0 .. E (no expert of these) are
// not counted. One block per chunk; dynamic shared memory: E ints.
__global__ void __launch_bounds__(SORT_THREADS) count_chunks(const int* ids, int slots, int E, int* hist, int* counts) {
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
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int c = sort_smem[e];
        hist[(long)blockIdx.x * E + e] = c;
        if (c > 0) atomicAdd(&counts[e], c);
    }
}

// The rows of chunk blockIdx.x's slots (hist and counts from count_chunks over the same ids):
// expert e's rows start at offsets[e] = the slots naming experts before e (cap = 0), or e · cap
// (padded: every expert owns cap rows), and offsets[E] = the total, written by block 0; within
// them, its slots in slot order. row_of_slot[s] = the row, slot_of_row[row] = s and
// expert_of_row[row] = e; slots of expert `skip` (an expert-parallel rank's "held elsewhere"
// bucket) get row -1 and no row; slots naming no expert of these are left alone. Dynamic shared
// memory: (SORT_WARPS + 1) E ints.
__global__ void __launch_bounds__(SORT_THREADS)
    scatter_chunks(const int* ids, int slots, int E, const int* hist, const int* counts, int cap, int skip,
                   int* offsets, int* row_of_slot, int* slot_of_row, int* expert_of_row) {
    extern __shared__ int sort_smem[];
    __shared__ int warp_sums[SORT_WARPS];
    int* next = sort_smem + E;  // [SORT_WARPS][E]: each warp's next row of each expert
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, chunk = blockIdx.x;
    int v[SORT_STEPS];
    const int base = sort_load(ids, slots, chunk, v);
    for (int i = threadIdx.x; i < SORT_WARPS * E; i += blockDim.x) next[i] = 0;
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
    // Each warp counts its slots per expert (the lowest lane of those naming one adds)...
    int* mine_next = next + w * E;
#pragma unroll
    for (int u = 0; u < SORT_STEPS; u++) {
        const unsigned peers = __match_any_sync(0xffffffffu, v[u]);
        if (v[u] >= 0 && v[u] < E && lane == __ffs(peers) - 1) mine_next[v[u]] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // ...which become each warp's first row of each expert: the chunk's start, then the warps
    // before it...
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

// dst[j, :] = src[idx[j], :] for j < n (bf16 rows); one block per row.
__global__ void take_rows(const bf16_t* src, const int* idx, int n, int H, bf16_t* dst) {
    int j = blockIdx.x;
    if (j >= n) return;
    copy_row(src + (long)idx[j] * H, dst + (long)j * H, H);
}

// act(g) * u for the activation kinds: 0 silu, 1 gelu erf, 2 gelu tanh, 3 GPT-OSS clamped swiglu.
// The sigmoids divide with __fdividef (2 ulp; 0 once exp overflows, the limit), which keeps
// the Hopper GEMM's activation epilogue short.
__device__ __forceinline__ float act_mul(float g, float u, int kind, float alpha, float limit) {
    if (kind == 0) return __fdividef(g, 1.0f + __expf(-g)) * u;
    if (kind == 1) return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * u;
    if (kind == 2) return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.0f) * __fdividef(g, 1.0f + __expf(-alpha * g));
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

// The weighted rows of one token, in slot order: acc[q] += w_j · (y[rows_j, h] + b2[ids_j, h]) for
// the eight columns h = 8c + q (sum_rows8; H % 8 == 0) or the one column h (sum_rows1), over the
// slots j < k whose row is not -1. `w` null means weight 1; `b2` null means no bias.
// (The rows are taken BATCH at a time, their values loaded before any is summed, so the loads
// overlap; the sums keep slot order. Batches of more than four load the weights with the row
// numbers, a round trip fewer for a decode step's few rows; the throughput kernels' batches of
// four load them as they sum, which keeps their registers, and blocks a SM, as they are.)
template <int BATCH = 4>
__device__ __forceinline__ void sum_rows8(const bf16_t* y, const float* b2, const int* rows, const int* ids,
                                          const float* w, int k, int H, int c, float* acc) {
    constexpr bool early = BATCH > 4;
    for (int j0 = 0; j0 < k; j0 += BATCH) {
        int r[BATCH];
        float wv[BATCH];
        uint4 raw[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; u++) {
            r[u] = j0 + u < k ? rows[j0 + u] : -1;
            if (early) wv[u] = w && j0 + u < k ? w[j0 + u] : 1.0f;
            else if (r[u] >= 0) raw[u] = ((const uint4*)(y + (long)r[u] * H))[c];
        }
        if (early) {
#pragma unroll
            for (int u = 0; u < BATCH; u++)
                if (r[u] >= 0) raw[u] = ((const uint4*)(y + (long)r[u] * H))[c];
        }
#pragma unroll
        for (int u = 0; u < BATCH; u++) {
            if (r[u] < 0) continue;
            float v[8];
            unpack8(raw[u], v);
            const float wj = early ? wv[u] : w ? w[j0 + u] : 1.0f;
            const float* bj = b2 ? b2 + (long)ids[j0 + u] * H + 8 * c : 0;
            for (int q = 0; q < 8; q++) acc[q] += wj * (bj ? v[q] + bj[q] : v[q]);
        }
    }
}
__device__ __forceinline__ float sum_rows1(const bf16_t* y, const float* b2, const int* rows, const int* ids,
                                           const float* w, int k, int H, int h) {
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        if (rows[j] < 0) continue;
        float v = bf16_to_f32(y[(long)rows[j] * H + h]);
        if (b2) v += b2[(long)ids[j] * H + h];
        acc += (w ? w[j] : 1.0f) * v;
    }
    return acc;
}

// Eight floats as eight bf16 in one 16-byte word.
__device__ __forceinline__ uint4 pack8(const float* f) {
    unsigned int o[4];
    for (int j = 0; j < 4; j++) o[j] = (unsigned int)f32_to_bf16(f[2 * j]) | ((unsigned int)f32_to_bf16(f[2 * j + 1]) << 16);
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// out_row[h] = the bf16 weighted sum of one token's rows (sum_rows8 / sum_rows1 over its k
// slots: rows, ids, weights), every column h < H, shared among the threads of the gridDim.y
// blocks of the token (this one the blockIdx.y-th); BATCH as in sum_rows8.
template <int BATCH = 4>
__device__ __forceinline__ void weighted_row_bf16(const bf16_t* y, const float* b2, const int* rows, const int* ids,
                                                  const float* w, int k, int H, bf16_t* out_row) {
    if (H % 8 == 0) {
        for (int c = threadIdx.x + blockIdx.y * blockDim.x; c < H / 8; c += blockDim.x * gridDim.y) {
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            sum_rows8<BATCH>(y, b2, rows, ids, w, k, H, c, acc);
            ((uint4*)out_row)[c] = pack8(acc);
        }
    } else {
        for (int h = threadIdx.x + blockIdx.y * blockDim.x; h < H; h += blockDim.x * gridDim.y) {
            out_row[h] = f32_to_bf16(sum_rows1(y, b2, rows, ids, w, k, H, h));
        }
    }
}

extern "C" {

// act[r, i] = act(h13[r, i] + b13[e, i]) * (h13[r, I + i] + b13[e, I + i]) (kinds: act_mul).
// expert_of_row may be null (dense MLP). Padded layout (cap > 0) with `counts`: rows past their
// expert's count are skipped. One block per row (grid-stride over rows); eight values per
// thread with 16-byte loads when I % 8 == 0.
__global__ void act_and_mul(const bf16_t* h13, const float* b13, const int* expert_of_row, int cap, const int* counts,
                            long R, int I, int kind, float alpha, float limit, bf16_t* out) {
    for (long r = blockIdx.x; r < R; r += gridDim.x) {
        if (cap > 0 && counts && r % cap >= counts[r / cap]) continue;
        int e = cap > 0 ? (int)(r / cap) : (expert_of_row ? expert_of_row[r] : 0);
        const bf16_t* gate = h13 + r * 2 * I;
        const bf16_t* up = gate + I;
        const float* bg = b13 ? b13 + (long)e * 2 * I : 0;
        if (I % 8 == 0) {
            for (int c = threadIdx.x; c < I / 8; c += blockDim.x) {
                float g[8], u[8];
                unpack8(((const uint4*)gate)[c], g);
                unpack8(((const uint4*)up)[c], u);
                unsigned int o[4];
                for (int j = 0; j < 8; j += 2) {
                    float v[2];
                    for (int q = 0; q < 2; q++) {
                        int i = 8 * c + j + q;
                        float gi = g[j + q], ui = u[j + q];
                        if (bg) { gi += bg[i]; ui += bg[I + i]; }
                        v[q] = act_mul(gi, ui, kind, alpha, limit);
                    }
                    o[j / 2] = (unsigned int)f32_to_bf16(v[0]) | ((unsigned int)f32_to_bf16(v[1]) << 16);
                }
                ((uint4*)(out + r * I))[c] = make_uint4(o[0], o[1], o[2], o[3]);
            }
        } else {
            for (int i = threadIdx.x; i < I; i += blockDim.x) {
                float g = bf16_to_f32(gate[i]), u = bf16_to_f32(up[i]);
                if (bg) { g += bg[i]; u += bg[I + i]; }
                out[r * I + i] = f32_to_bf16(act_mul(g, u, kind, alpha, limit));
            }
        }
    }
}

// out[t, h] = sum_j w[t, j] * (y[row_of_slot[t k + j], h] + b2[ids[t k + j], h]), in slot order,
// then + g_t * ys[t, h] when the shared output `ys` is given (g_t as in add_shared). Blocks
// (x, y) take tokens x, x + gridDim.x, ... and the y-th of gridDim.y interleaved shares of their
// columns (small batches spread a token over several blocks, since one block a token leaves
// the GPU idle); eight columns per thread with 16-byte loads when H % 8 == 0.
__global__ void combine(const bf16_t* y, const float* b2, const int* ids, const float* w, const int* row_of_slot, int T,
                        int k, int H, int weights_applied, const bf16_t* ys, const float* x, const float* gate,
                        float* out) {
    __shared__ float red[32];
    for (long t = blockIdx.x; t < T; t += gridDim.x) {
        float g = ys ? shared_gate(x, gate, t, H, red) : 0.0f;
        const int *rs = row_of_slot + t * k, *id = ids + t * k;
        const float* wt = weights_applied ? 0 : w + t * k;
        if (H % 8 == 0) {
            for (int c = threadIdx.x + blockIdx.y * blockDim.x; c < H / 8; c += blockDim.x * gridDim.y) {
                float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                sum_rows8(y, b2, rs, id, wt, k, H, c, acc);
                if (ys) {
                    float sh[8];
                    unpack8(((const uint4*)(ys + t * H))[c], sh);
                    for (int q = 0; q < 8; q++) acc[q] += g * sh[q];
                }
                float4* o = (float4*)(out + t * H + 8 * c);
                o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
            }
        } else {
            for (int h = threadIdx.x + blockIdx.y * blockDim.x; h < H; h += blockDim.x * gridDim.y) {
                float acc = sum_rows1(y, b2, rs, id, wt, k, H, h);
                if (ys) acc += g * bf16_to_f32(ys[t * H + h]);
                out[t * H + h] = acc;
            }
        }
    }
}

// Expert-parallel, on the rank holding the experts: part[t, h] = sum over the slots of received
// token t whose expert is here (row >= 0) of w * (y[row, h] + b2[expert, h]), in slot order, as
// bf16. One block per token, as combine.
__global__ void combine_partial(const bf16_t* y, const float* b2, const int* local_ids, const float* w,
                                const int* row_of_slot, int T, int k, int H, bf16_t* part) {
    for (long t = blockIdx.x; t < T; t += gridDim.x) {
        weighted_row_bf16(y, b2, row_of_slot + t * k, local_ids + t * k, w + t * k, k, H, part + t * H);
    }
}

}  // extern "C"

// out[t, 8c .. 8c + 7] = acc, plus ys[t, 8c .. 8c + 7] (an ungated shared expert's output)
// first when `ys` is not null.
__device__ __forceinline__ void store_sum8(float* out, const bf16_t* ys, long t, int H, int c, float* acc) {
    if (ys) {
        float sh[8];
        unpack8(((const uint4*)(ys + t * H))[c], sh);
#pragma unroll
        for (int q = 0; q < 8; q++) acc[q] += sh[q];
    }
    float4* o = (float4*)(out + t * H + 8 * c);
    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

// Expert-parallel, at home: out[t, h] = sum over ranks d in rank order of part[rows[t n + d], h]
// (rows -1 where token t sent nothing to d), then + ys[t, h] (an ungated shared expert's
// output) when `ys` is not null, for the first T tokens, or the first *live when `live` is not
// null. A token's columns are shared by `chunks` blocks: gridDim.y (per_token's split) without
// `live`; with it, as many as keep about gridDim.x blocks busy (a graph's grid is set by the
// capacity T, the batch is read here: one token takes gridDim.y blocks, a full batch one each).
// A thread takes TURN of its 8-column groups at a time, their loads in flight together.
template <int TURN>
__device__ __forceinline__ void sum_partials_at(const bf16_t* part, const int* rows, int T, int n, int H,
                                                const int* live, const bf16_t* ys, float* out) {
    int chunks = gridDim.y;
    if (live) {
        T = min(T, *live);
        chunks = max(1, min((int)gridDim.y, (int)gridDim.x / max(T, 1)));
    }
    for (long item = (long)blockIdx.y * gridDim.x + blockIdx.x; item < (long)T * chunks;
         item += (long)gridDim.x * gridDim.y) {
        long t = item / chunks;
        int first = (int)(item % chunks) * blockDim.x + threadIdx.x, step = blockDim.x * chunks;
        const int* rt = rows + t * n;
        if (H % 8 == 0) {
            if constexpr (TURN == 1) {
                for (int c = first; c < H / 8; c += step) {
                    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                    sum_rows8(part, 0, rt, 0, 0, n, H, c, acc);
                    store_sum8(out, ys, t, H, c, acc);
                }
            } else {
                // TURN column groups at a time, the rows of two ranks at a time: every load is
                // issued before any is summed, so they are in flight together. Each column still
                // sums its ranks in rank order.
                for (int c0 = first; c0 < H / 8; c0 += TURN * step) {
                    float acc[TURN][8];
#pragma unroll
                    for (int u = 0; u < TURN; u++)
#pragma unroll
                        for (int q = 0; q < 8; q++) acc[u][q] = 0.0f;
                    for (int d0 = 0; d0 < n; d0 += 2) {
                        int r[2];
                        uint4 raw[TURN][2];
#pragma unroll
                        for (int v = 0; v < 2; v++) r[v] = d0 + v < n ? rt[d0 + v] : -1;
#pragma unroll
                        for (int u = 0; u < TURN; u++)
#pragma unroll
                            for (int v = 0; v < 2; v++)
                                if (r[v] >= 0 && c0 + u * step < H / 8)
                                    raw[u][v] = ((const uint4*)(part + (long)r[v] * H))[c0 + u * step];
#pragma unroll
                        for (int u = 0; u < TURN; u++)
#pragma unroll
                            for (int v = 0; v < 2; v++) {
                                if (r[v] < 0 || c0 + u * step >= H / 8) continue;
                                float f[8];
                                unpack8(raw[u][v], f);
#pragma unroll
                                for (int q = 0; q < 8; q++) acc[u][q] += f[q];
                            }
                    }
#pragma unroll
                    for (int u = 0; u < TURN; u++) {
                        const int c = c0 + u * step;
                        if (c < H / 8) store_sum8(out, ys, t, H, c, acc[u]);
                    }
                }
            }
        } else {
            for (int h = first; h < H; h += step) {
                float acc = sum_rows1(part, 0, rt, 0, 0, n, H, h);
                if (ys) acc += bf16_to_f32(ys[t * H + h]);
                out[t * H + h] = acc;
            }
        }
    }
}

extern "C" {

// sum_partials_at for the batches sized on the host, bound by memory bandwidth: a group at a
// time, which keeps the registers for more blocks a SM.
__global__ void sum_partials(const bf16_t* part, const int* rows, int T, int n, int H, const int* live,
                             const bf16_t* ys, float* out) {
    sum_partials_at<1>(part, rows, T, n, H, live, ys, out);
}

// sum_partials_at for the low-latency batch read on the device (`live`), a few rows a block and
// bound by the loads' latency: four groups at a time.
__global__ void sum_partials_live(const bf16_t* part, const int* rows, int T, int n, int H, const int* live,
                                  const bf16_t* ys, float* out) {
    sum_partials_at<4>(part, rows, T, n, H, live, ys, out);
}

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

// x[t, :] *= w[t] (router weight applied on the input, top-1).
__global__ void scale_rows_bf16(bf16_t* x, const float* w, int T, int H) {
    long n = (long)T * H;
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < n; idx += (long)gridDim.x * blockDim.x)
        x[idx] = f32_to_bf16(bf16_to_f32(x[idx]) * w[idx / H]);
}

// out[t, :] += g_t * ys[t, :], g_t = sigmoid(x[t] . gate) when gate is given, else 1. One block per token
// (the first *live when `live` is not null).
__global__ void add_shared(float* out, const bf16_t* ys, const float* x, const float* gate, int T, int H,
                           const int* live) {
    int t = blockIdx.x;
    if (t >= T || (live && t >= *live)) return;
    __shared__ float red[32];
    float g = shared_gate(x, gate, t, H, red);
    for (int h = threadIdx.x; h < H; h += blockDim.x) out[(long)t * H + h] += g * bf16_to_f32(ys[(long)t * H + h]);
}

}  // extern "C"

// ---- Quantization of rows (must match crates/moeflow/src/quant bit for bit) ----
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
#pragma unroll
        for (int j = 0; j < 16; j++) q[j] = s > 0.0f ? quantize_code(v[j] / s, kind) : 0;
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

// bf16 rows to codes and scales, or to the values they stand for (see quantize_rows_of). Six
// blocks of 256 threads a SM (40 registers a thread, against 51 unbounded): the pass is bound
// by its loads' latency, so more of them in flight (docs/tuning.md).
__global__ void __launch_bounds__(256, 6)
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

extern "C" {

// Deterministic mode's router GEMM, in two launches whose sums have one fixed order for any
// batch, so a token's logits are the same bits alone and in any batch. First the partial dot
// products over ROUTER_FIXED_COLS columns each: partial[z, t, e] = the sum over k in block z, in
// order, of x[t, k] * gate[e, k] (f32 fma); 64 tokens × 64 experts a block of 256 threads (4 × 4
// a thread), the depth in chunks of 16 through shared memory; blockIdx.z is the column block.
#define ROUTER_FIXED_COLS 256
__global__ void router_partials_fixed(const float* x, const float* gate, int T, int E, int H, float* partial) {
    __shared__ float xs[16][65];
    __shared__ float gs[16][65];
    int t0 = blockIdx.x * 64, e0 = blockIdx.y * 64;
    int k_lo = blockIdx.z * ROUTER_FIXED_COLS, k_hi = min(H, k_lo + ROUTER_FIXED_COLS);
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    // 256 threads: each loads 4 values of each 64 × 16 chunk, the next chunk's loads issued
    // before this chunk's products (the same products in the same order).
    float xr[4], gr[4];
    auto load = [&](int k0) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int q = threadIdx.x + 256 * u, r = q / 16, kk = q % 16, k = k0 + kk;
            int t = t0 + r, e = e0 + r;
            xr[u] = (t < T && k < k_hi) ? x[(long)t * H + k] : 0.0f;
            gr[u] = (e < E && k < k_hi) ? gate[(long)e * H + k] : 0.0f;
        }
    };
    load(k_lo);
    for (int k0 = k_lo; k0 < k_hi; k0 += 16) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int q = threadIdx.x + 256 * u;
            xs[q % 16][q / 16] = xr[u];
            gs[q % 16][q / 16] = gr[u];
        }
        __syncthreads();
        if (k0 + 16 < k_hi) load(k0 + 16);
        int depth = min(16, k_hi - k0);
        for (int kk = 0; kk < depth; kk++) {
            float a[4], b[4];
            for (int i = 0; i < 4; i++) a[i] = xs[kk][ty * 4 + i];
            for (int j = 0; j < 4; j++) b[j] = gs[kk][tx * 4 + j];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    float* out = partial + (long)blockIdx.z * T * E;
    for (int i = 0; i < 4; i++) {
        int t = t0 + ty * 4 + i;
        for (int j = 0; j < 4; j++) {
            int e = e0 + tx * 4 + j;
            if (t < T && e < E) out[(long)t * E + e] = acc[i][j];
        }
    }
}

// router_partials_fixed for large batches, H a multiple of 4: 128 × 128 tiles, each thread
// 8 × 8 outputs (rows ty·4.. and 64 + ty·4.., columns tx·4.. and 64 + tx·4..), tiles loaded
// four columns at a time and read from shared memory as float4 (rows padded to 132 floats so
// the transposing stores spread over the banks). Every output is the same chain of fmaf over
// its block's columns in column order as in router_partials_fixed, so the partials are bit for
// bit the same; only the tiling differs.
__global__ void router_partials_fixed_wide(const float* x, const float* gate, int T, int E, int H, float* partial) {
    __shared__ __align__(16) float xs[16][132];
    __shared__ __align__(16) float gs[16][132];
    int t0 = blockIdx.x * 128, e0 = blockIdx.y * 128;
    int k_lo = blockIdx.z * ROUTER_FIXED_COLS, k_hi = min(H, k_lo + ROUTER_FIXED_COLS);
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[8][8];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int k0 = k_lo; k0 < k_hi; k0 += 16) {
        for (int q = threadIdx.x; q < 128 * 4; q += blockDim.x) {
            int r = q / 4, k4 = (q % 4) * 4, k = k0 + k4;
            int t = t0 + r, e = e0 + r;
            float4 xv = (t < T && k < k_hi) ? *reinterpret_cast<const float4*>(&x[(long)t * H + k]) : zero;
            float4 gv = (e < E && k < k_hi) ? *reinterpret_cast<const float4*>(&gate[(long)e * H + k]) : zero;
            xs[k4][r] = xv.x; xs[k4 + 1][r] = xv.y; xs[k4 + 2][r] = xv.z; xs[k4 + 3][r] = xv.w;
            gs[k4][r] = gv.x; gs[k4 + 1][r] = gv.y; gs[k4 + 2][r] = gv.z; gs[k4 + 3][r] = gv.w;
        }
        __syncthreads();
        int depth = min(16, k_hi - k0);
        for (int kk = 0; kk < depth; kk++) {
            float4 a0 = *reinterpret_cast<const float4*>(&xs[kk][ty * 4]);
            float4 a1 = *reinterpret_cast<const float4*>(&xs[kk][64 + ty * 4]);
            float4 b0 = *reinterpret_cast<const float4*>(&gs[kk][tx * 4]);
            float4 b1 = *reinterpret_cast<const float4*>(&gs[kk][64 + tx * 4]);
            float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < 8; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    float* out = partial + (long)blockIdx.z * T * E;
    for (int i = 0; i < 8; i++) {
        int t = t0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        for (int j = 0; j < 8; j++) {
            int e = e0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (t < T && e < E) out[(long)t * E + e] = acc[i][j];
        }
    }
}

// Then logits[t, e] = the sum of the `blocks` partials in block order, plus bias[e] when `bias` is
// not null; with `live` (not null) only the first *live rows.
__global__ void router_sum_fixed(const float* partial, int T, int E, int blocks, const float* bias, const int* live,
                                 float* logits) {
    long n = (long)T * E, m = live ? (long)min(T, max(*live, 0)) * E : n;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < m; i += (long)gridDim.x * blockDim.x) {
        // Eight loads in flight before their additions (in order), not one load per addition.
        float s = 0.0f;
        int z = 0;
        for (; z + 8 <= blocks; z += 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = partial[(z + u) * n + i];
#pragma unroll
            for (int u = 0; u < 8; u++) s += v[u];
        }
        for (; z < blocks; z++) s += partial[z * n + i];
        logits[i] = bias ? s + bias[i % E] : s;
    }
}

// The low-latency graph's router GEMM, for the first *live of T rows (the batch, read on the
// device; the grid covers all T): partial[z, t, e] = the sum over the ROUTER_LIVE_COLS columns of
// block z, in order, of x[t, k] * gate[e, k] (f32 fma). A block takes 64 experts (blockIdx.x), one
// column block (blockIdx.y) and up to ROUTER_LIVE_ROWS rows (blockIdx.z): it loads its whole gate
// tile at once (every load in flight, where a loop over the columns would wait for each chunk),
// then takes the live rows 32 at a time, each thread rows ty and ty + 16 of experts 4 tx .. 4 tx
// + 3 (one 16-byte read of the gate tile a column). router_sum_fixed adds the partials.
#define ROUTER_LIVE_COLS 112
#define ROUTER_LIVE_ROWS 128
__global__ void __launch_bounds__(256) router_live_partials(const float* x, const float* gate, int T, int E, int H,
                                                            const int* live, float* partial) {
    __shared__ __align__(16) float gs[ROUTER_LIVE_COLS][68];
    __shared__ float xs[ROUTER_LIVE_COLS][33];
    const int rows = min(T, max(*live, 0));
    const int e0 = blockIdx.x * 64, k0 = blockIdx.y * ROUTER_LIVE_COLS, t_lo = blockIdx.z * ROUTER_LIVE_ROWS;
    const int t_hi = min(rows, t_lo + ROUTER_LIVE_ROWS), depth = min(ROUTER_LIVE_COLS, H - k0);
    if (t_lo >= t_hi) return;
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    // Every load of a tile is issued before any of them is stored (256 threads a block).
    constexpr int GATE_LOADS = 64 * ROUTER_LIVE_COLS / 256, X_LOADS = 32 * ROUTER_LIVE_COLS / 256;
    {
        float v[GATE_LOADS];
#pragma unroll
        for (int u = 0; u < GATE_LOADS; u++) {
            const int q = tid + 256 * u, r = q / ROUTER_LIVE_COLS, kk = q % ROUTER_LIVE_COLS, e = e0 + r;
            v[u] = (e < E && kk < depth) ? gate[(long)e * H + k0 + kk] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < GATE_LOADS; u++) {
            const int q = tid + 256 * u;
            gs[q % ROUTER_LIVE_COLS][q / ROUTER_LIVE_COLS] = v[u];
        }
    }
    float* out = partial + (long)blockIdx.y * T * E;
    for (int t0 = t_lo; t0 < t_hi; t0 += 32) {
        float v[X_LOADS];
#pragma unroll
        for (int u = 0; u < X_LOADS; u++) {
            const int q = tid + 256 * u, r = q / ROUTER_LIVE_COLS, kk = q % ROUTER_LIVE_COLS, t = t0 + r;
            v[u] = (t < t_hi && kk < depth) ? x[(long)t * H + k0 + kk] : 0.0f;
        }
        __syncthreads();  // the gate tile is in; the last row tile's reads are done
#pragma unroll
        for (int u = 0; u < X_LOADS; u++) {
            const int q = tid + 256 * u;
            xs[q % ROUTER_LIVE_COLS][q / ROUTER_LIVE_COLS] = v[u];
        }
        __syncthreads();
        float acc[2][4] = {};
        for (int kk = 0; kk < depth; kk++) {
            const float a0 = xs[kk][ty], a1 = xs[kk][ty + 16];
            const float4 g = *reinterpret_cast<const float4*>(&gs[kk][4 * tx]);
            const float gv[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                acc[0][j] = fmaf(a0, gv[j], acc[0][j]);
                acc[1][j] = fmaf(a1, gv[j], acc[1][j]);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int t = t0 + ty + 16 * i;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int e = e0 + 4 * tx + j;
                if (t < t_hi && e < E) out[(long)t * E + e] = acc[i][j];
            }
        }
    }
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

}
