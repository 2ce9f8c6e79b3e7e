// The router's top-k on the GPU: every token's experts and weights from its logits, for each
// router kind, a warp a token; and the whole routing of a few tokens in one launch. (Compiled
// after common.cu.)

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
// that its one routing block runs cold at every launch. With x_codes (else null), the bf16
// copy's fp8 codes [T, H] and scales [T, ceil(H / 128)] too, one group of 128 a block, the bits
// of quantize_rows_bf16 (fp8_group128_of_warp): a W8A8 layer's GEMMs gather the tokens' codes,
// and no pass of its own quantizes them. With load_rows (else null), the counts also go into the
// load statistics' ring as count_expert_load writes them (row *load_calls mod load_window of
// load_rows [load_window, E], then *load_calls advanced), so that no launch of its own counts.
#define ROUTE_SMALL_TOKENS 4
#define ROUTE_SMALL_EXPERTS 128
#define ROUTE_SMALL_COLS 128
__device__ float fp8_group128_of_warp(const float* v, unsigned char* q);  // quant.cu
__global__ void route_small(const float* x, const float* gate, const float* gate_bias, const float* corr_bias, int T,
                            int H, int E, int k, int kind, int n_group, int topk_group, int renorm, float scaling,
                            float* partials, int* done, bf16_t* x_bf, float* logits, int* ids, float* weights,
                            int* counts, int* offsets, int* row_of_slot, int* slot_of_row, int* expert_of_row,
                            unsigned char* x_codes, float* x_scales, unsigned* load_rows, int load_window,
                            unsigned long long* load_calls) {
    __shared__ float xs[ROUTE_SMALL_TOKENS][ROUTE_SMALL_COLS];
    __shared__ float sc[ROUTE_SMALL_TOKENS][MAX_E];
    __shared__ float group_score[ROUTE_SMALL_TOKENS][64];
    __shared__ int sid[ROUTE_SMALL_TOKENS * MAX_K];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int c0 = blockIdx.x * ROUTE_SMALL_COLS;
    for (int i = threadIdx.x; i < T * ROUTE_SMALL_COLS; i += blockDim.x) {
        const int t = i / ROUTE_SMALL_COLS, c = c0 + i % ROUTE_SMALL_COLS;
        const float v = c < H ? x[(long)t * H + c] : 0.0f;
        xs[t][i % ROUTE_SMALL_COLS] = v;
        if (c < H) x_bf[(long)t * H + c] = f32_to_bf16(v);
    }
    __syncthreads();
    if (x_codes) {
        // Warp t quantizes token t's bf16 values of these columns (zeros past H leave the
        // group's largest magnitude as it is), lane l columns 4 l .. 4 l + 3.
        for (int t = warp; t < T; t += warps) {
            float v[4];
            unsigned char q[4];
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = bf16_to_f32(f32_to_bf16(xs[t][4 * lane + j]));
            const float s = fp8_group128_of_warp(v, q);
            if (lane == 0) x_scales[(long)t * ((H + ROUTE_SMALL_COLS - 1) / ROUTE_SMALL_COLS) + blockIdx.x] = s;
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (c0 + 4 * lane + j < H) x_codes[(long)t * H + c0 + 4 * lane + j] = q[j];
        }
    }
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
    if (!last_block_here(done)) return;
    // Read by every thread here; thread 0 advances it at the end, past several barriers.
    const unsigned long long call = load_rows ? *load_calls : 0;
    unsigned* load_row = load_rows ? load_rows + call % (unsigned long long)load_window * E : nullptr;
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
        if (e < E && load_row) load_row[e] = here;
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
    if (threadIdx.x == 0 && load_rows) *load_calls = call + 1;
}

}  // extern "C"
