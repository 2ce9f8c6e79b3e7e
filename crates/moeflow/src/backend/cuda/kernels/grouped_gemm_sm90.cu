// moeflow's Hopper grouped GEMM: C[r] = A[r] · W[e]ᵀ for every row r of expert e, over all the
// experts in one persistent launch, bf16 in and out, f32 accumulation. Expert e's rows are
// A[offsets[e] .. offsets[e] + counts[e]) (grouped or padded layout, both read on the device,
// so no host read decides the launch); W is [experts · N, K], K contiguous.
//
// With an activation (act_kind >= 0, the up projection) W holds each expert's gate rows then
// its up rows (N = 2 I) and the epilogue writes act(gate + b13) · (up + b13) instead, C being
// [rows, I]: a tile takes 128 gate and the 128 matching up rows of W, so each lane holds the
// gate and up value of the same output column, straight from the f32 accumulators.
//
// With gather_x (the up projection on one GPU and in the expert-parallel layer) the rows of A
// are not read from a permuted copy: the producer warpgroup copies each token's row into the
// stage itself with cp.async, eight threads a row, in the swizzled layout TMA would write (one
// thread a row, each warp instruction touching 32 rows, is much slower; docs/tuning.md).
//
// Built for sm_90a (wgmma and TMA exist only there): each block owns an SM and takes the
// 128 × 256 output tiles of every expert, in order, from a counter the blocks share (the
// last block done claiming zeroes it for the next launch). One producer thread streams 64-deep slices of the
// tile's rows and weights (two boxes of 128 weight rows) into a 4-stage shared-memory ring
// with TMA (128-byte swizzle, zero fill past the tensor's edges); two consumer warpgroups
// multiply them with wgmma.m64n256k16 (64 rows each) straight from shared memory, and hand
// each stage back through an mbarrier once the tensor cores are done with it. An expert's last
// tile also takes the up to 32 rows past its 128 that end the expert (its tail), which would
// otherwise make a tile of their own that streams the same weights again for a few rows: the
// stage brings them beside the 128, and each consumer warpgroup multiplies them against two
// 64-row boxes of the weights with the operands swapped (wgmma.m64n32k16), giving each output
// the bits the 64-row fragments give it (docs/tuning.md). The epilogue
// rounds to bf16 and stores only the expert's own rows, so rows read past its end (the next
// expert's, or zeros) are computed and dropped. A second entry point takes tiles of 64 rows
// with one consumer warpgroup and a 5-stage ring, for batches of a few rows an expert, and a
// third the same in tiles 224 columns wide (products only), for better balanced waves. On
// other architectures the kernel bodies are empty and the host never launches them.
// (Compiled after common.cu and activation.cu, whose typedefs and act_mul it uses.)

#define GG_BK 64                                   // depth of a stage: 128 bytes, one swizzle row

// A CUtensorMap, passed by value (the host encodes it with cuTensorMapEncodeTiled).
struct __align__(64) gg_tensor_map {
    u64 opaque[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ unsigned gg_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void gg_bar_init(u64* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(gg_smem(bar)), "r"(count));
}
// Arrives once and announces `bytes` of TMA traffic that completes the phase.
__device__ __forceinline__ void gg_bar_expect(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(gg_smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void gg_bar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(gg_smem(bar)) : "memory");
}
// Spins until the phase of parity `parity` has completed.
__device__ __forceinline__ void gg_bar_wait(u64* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\n"
        "WAIT:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT;\n}\n" ::"r"(gg_smem(bar)),
        "r"(parity)
        : "memory");
}

// Box (x = column, y = row) of `map` into shared memory, completing on `bar`.
__device__ __forceinline__ void gg_tma_load(void* dst, const gg_tensor_map* map, u64* bar, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            gg_smem(dst)),
        "l"((u64)map), "r"(x), "r"(y), "r"(gg_smem(bar))
        : "memory");
}

// 16 bytes from `src` (0 bytes, zeros, when `bytes` is 0) to shared memory, and an arrival on
// `bar` once this thread's copies so far have landed (the barrier counts it in advance).
__device__ __forceinline__ void gg_copy16(void* dst, const void* src, unsigned bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(gg_smem(dst)), "l"(src), "r"(bytes) : "memory");
}
// A 4-byte copy, global to shared memory, by cp.async.
__device__ __forceinline__ void gg_copy4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(gg_smem(dst)), "l"(src) : "memory");
}
// Arrives on `bar` once this thread's cp.async copies so far have landed (no arrival of its
// own counted: the barrier's count includes this one).
__device__ __forceinline__ void gg_copies_arrive(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(gg_smem(bar)) : "memory");
}

// wgmma descriptor of a K-major tile in shared memory with 128-byte swizzle: rows of 128
// bytes, 8-row groups 1024 bytes apart (the tile starts 1024-aligned), as its two words: the
// low one (start address in 16-byte units and the leading offset) from gg_desc_lo, the high
// one (the group stride and the swizzle) always GG_DESC_HI. A tile n bytes further has the low
// word n / 16 larger (2 more: 32 bytes deeper), with no carry out of the address field while
// shared memory stays below 256 KiB.
#define GG_DESC_HI 0x40000040u
__device__ __forceinline__ unsigned gg_desc_lo(const void* p) { return ((gg_smem(p) & 0x3FFFF) >> 4) | (1u << 16); }
// The whole descriptor.
__device__ __forceinline__ u64 gg_desc(const void* p) { return (u64)GG_DESC_HI << 32 | gg_desc_lo(p); }

__device__ __forceinline__ void gg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void gg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int pending>
__device__ __forceinline__ void gg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}
// Pins the accumulators in place: reads of d after this stay after the wait before it (the
// compiler cannot see that wgmma writes d asynchronously).
template <int N>
__device__ __forceinline__ void gg_pin(float* d) {
#pragma unroll
    for (int j = 0; j < N; j++) asm volatile("" : "+f"(d[j])::"memory");
}

#define GG_D8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])

// d[64 × 256 fragment] (+)= A[64 × 16] · B[256 × 16]ᵀ, both from shared memory; `accumulate`
// 0 overwrites d.
__device__ __forceinline__ void gg_mma(float* d, u64 a, u64 b, int accumulate) {
    asm volatile(
        "{\n .reg .pred acc;\n setp.ne.b32 acc, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, acc, 1, 1, 0, 0;\n}\n"
        : GG_D8(0), GG_D8(8), GG_D8(16), GG_D8(24), GG_D8(32), GG_D8(40), GG_D8(48), GG_D8(56), GG_D8(64),
          GG_D8(72), GG_D8(80), GG_D8(88), GG_D8(96), GG_D8(104), GG_D8(112), GG_D8(120)
        : "l"(a), "l"(b), "r"(accumulate));
}

// The same over 224 columns: d[64 × 224 fragment], B[224 × 16].
__device__ __forceinline__ void gg_mma224(float* d, u64 a, u64 b, int accumulate) {
    asm volatile(
        "{\n .reg .pred acc;\n setp.ne.b32 acc, %114, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n224k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
        "}, %112, %113, acc, 1, 1, 0, 0;\n}\n"
        : GG_D8(0), GG_D8(8), GG_D8(16), GG_D8(24), GG_D8(32), GG_D8(40), GG_D8(48), GG_D8(56), GG_D8(64), GG_D8(72), GG_D8(80), GG_D8(88), GG_D8(96), GG_D8(104)
        : "l"(a), "l"(b), "r"(accumulate));
}

// d[64 × 32 fragment] (+)= A[64 × 16] · B[32 × 16]ᵀ: a tail's products with the operands
// swapped, 64 weight rows as A and the tail's 32 rows as B.
__device__ __forceinline__ void gg_mma32(float* d, u64 a, u64 b, int accumulate) {
    asm volatile(
        "{\n .reg .pred acc;\n setp.ne.b32 acc, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, acc, 1, 1, 0, 0;\n}\n"
        : GG_D8(0), GG_D8(8)
        : "l"(a), "l"(b), "r"(accumulate));
}

// Two f32 rounded to nearest-even bf16, `lo` in the low half.
__device__ __forceinline__ unsigned gg_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The tile's output columns in place of its gate columns, for a tile of G 8-column groups of
// gate rows then G of up rows (G = 16: 128 each): d[4j + x] (j < G) becomes
// act(gate + bias) · (up + bias) from d[4j + x] and d[4(j + G) + x]; `bias` is the expert's
// 2 I gate-then-up row (null: none), `col0` the tile's first output column, `I` the width.
// Straight-line code, kept short: the bias loop is skipped when there is none, and act_mul
// divides with __fdividef (IEEE divisions cost the up projection several times what the
// activation itself does; docs/tuning.md).
template <int KIND, int G>
__device__ __forceinline__ void gg_act(float* d, const float* bias, int col0, int I, float alpha, float limit) {
    const int q = threadIdx.x % 4;
    if (bias) {
#pragma unroll
        for (int j = 0; j < G; j++) {
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int c = min(col0 + 8 * j + 2 * q + (x & 1), I - 1);  // columns past I are dropped
                d[4 * j + x] += bias[c];
                d[4 * (j + G) + x] += bias[I + c];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 4 * G; j++) d[j] = act_mul(d[j], d[j + 4 * G], KIND, alpha, limit);
}

// gg_act for the epilogue's act_kind.
template <int G>
__device__ __forceinline__ void gg_act_kind(float* d, int act_kind, const float* bias, int col0, int I, float alpha,
                                            float limit) {
    switch (act_kind) {
        case 0: gg_act<0, G>(d, bias, col0, I, alpha, limit); break;
        case 1: gg_act<1, G>(d, bias, col0, I, alpha, limit); break;
        case 2: gg_act<2, G>(d, bias, col0, I, alpha, limit); break;
        default: gg_act<3, G>(d, bias, col0, I, alpha, limit); break;
    }
}

// Stores the first `cols` columns of a warpgroup's 64-row fragment d as bf16 rows of C
// [·, width], from row `row0` and column `col0`, rows up to `rows_end` and columns up to
// `width`. Fragment layout: d[4j + {0,1}] is row 16·warp + lane/4, columns 8j + 2·(lane%4) +
// {0,1}; d[4j + {2,3}] the row 8 below. Stores move eight bytes a lane: lanes q and q ^ 1 of
// a quad trade one pair of each two 8-column chunks, so that the even lane holds four
// columns of the first chunk and the odd lane the same four of the second, and each store
// fills whole 32-byte sectors (one exchange a store where sixteen bytes a lane took two and a
// dozen selects; docs/tuning.md).
//
// Where the rows go: row r of C [·, width], or with SCATTER the address rows[r] (read only for
// rows below rows_end), each row's own.
template <bool SCATTER>
struct gg_out {
    bf16_t* C;
    const u64* rows;
    __device__ __forceinline__ bf16_t* row(long r, int width) const {
        if constexpr (SCATTER) return (bf16_t*)rows[r];
        else return C + r * width;
    }
};
template <int COLS, bool SCATTER>
__device__ __forceinline__ void gg_store_to(const float* d, gg_out<SCATTER> out, long row0, int rows_end, int col0,
                                            int width) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const long r = row0 + warp * 16 + lane / 4;
    const int q = lane % 4;
    const bool odd = q & 1;
    const int col = col0 + 8 * odd + 4 * (q >> 1);  // this lane's first column, chunk pair 0
    const bool row_in[2] = {r < rows_end, r + 8 < rows_end};
    bf16_t *at, *below = nullptr;  // row r's first column, and with SCATTER row r + 8's
    if constexpr (SCATTER) {
        at = row_in[0] ? out.row(r, width) + col : nullptr;
        below = row_in[1] ? out.row(r + 8, width) + col : nullptr;
    } else {
        at = out.row(r, width) + col;
    }
#pragma unroll
    for (int i = 0; i < COLS / 16; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            // This lane's pairs of chunks 2i (a) and 2i + 1 (b), row r + 8h.
            const unsigned a = gg_pack(d[4 * (2 * i) + 2 * h], d[4 * (2 * i) + 2 * h + 1]);
            const unsigned b = gg_pack(d[4 * (2 * i + 1) + 2 * h], d[4 * (2 * i + 1) + 2 * h + 1]);
            const unsigned got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);
            if (row_in[h] && col + 16 * i < width) {
                bf16_t* p;
                if constexpr (SCATTER) p = h ? below : at;
                else p = at + (h ? 8L * width : 0L);
                *(uint2*)(p + 16 * i) = odd ? make_uint2(got, b) : make_uint2(a, got);
            }
        }
    }
}
template <int COLS>
__device__ __forceinline__ void gg_store(const float* d, bf16_t* C, long row0, int rows_end, int col0, int width) {
    gg_store_to<COLS, false>(d, gg_out<false>{C, nullptr}, row0, rows_end, col0, width);
}

// Stores a tail's outputs: e holds warpgroup wg's sums over the `tail` rows from `row0` of
// two boxes of 64 weight rows (e[16 j + x], box j: the tile's weight rows 64·wg + 128·j ..,
// m64n32 fragments, x as wgmma's: weight row 16·warp + lane/4 + 8·((x >> 1) & 1) of the box,
// tail row 8·(x >> 2) + 2·(lane % 4) + (x & 1)). Without an activation box j gives output
// columns col0 + 128·j + 64·wg ..; with one, the boxes are the gate and up rows of output
// columns col0 + 64·wg .., biased and combined as gg_act does, so each output gets the bits the
// 64-row fragments give it.
template <bool SCATTER>
__device__ __forceinline__ void gg_store_tail(const float* e, gg_out<SCATTER> o, long row0, int tail, int col0,
                                              int width, int wg, int act_kind, const float* bias, float alpha,
                                              float limit) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, q = lane % 4;
#pragma unroll
    for (int x = 0; x < 16; x++) {
        const int r = 8 * (x >> 2) + 2 * q + (x & 1), w = 16 * warp + lane / 4 + 8 * ((x >> 1) & 1);
        if (r >= tail) continue;
        bf16_t* out = o.row(row0 + r, width);
        if (act_kind >= 0) {
            const int col = col0 + 64 * wg + w;
            float g = e[x], u = e[16 + x];
            if (bias) {
                const int c = min(col, width - 1);
                g += bias[c];
                u += bias[width + c];
            }
            if (col < width) out[col] = (bf16_t)(gg_pack(act_mul(g, u, act_kind, alpha, limit), 0.0f) & 0xffffu);
        } else {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int col = col0 + 128 * j + 64 * wg + w;
                if (col < width) out[col] = (bf16_t)(gg_pack(e[16 * j + x], 0.0f) & 0xffffu);
            }
        }
    }
}

// The tiles of every expert laid end to end. Within an expert, row blocks go in groups of
// GG_GROUP: a group's tiles run column block by column block, row blocks fastest, so the
// blocks running at once share weight columns and rows in L2 (an expert of at most GG_GROUP
// row blocks is one group).
#define GG_GROUP 16
struct gg_tile {
    int expert, row0, rows_end, col0;
};

// Row blocks of BM rows over an expert of `rows` rows, where the last one also takes up to
// TAIL rows past its BM (they end the expert) instead of a block of their own.
template <int BM, int TAIL>
__device__ __forceinline__ int gg_row_blocks(int rows) {
    if (TAIL == 0 || rows <= BM) return (rows + BM - 1) / BM;
    return (rows - TAIL - 1) / BM + 1;
}

// The rows past BM that tile t takes (0 < tail <= TAIL: they end its expert), or 0. Every
// block but an expert's last has more than BM + TAIL rows from its first to the expert's end.
template <int BM, int TAIL>
__device__ __forceinline__ int gg_tail_of(const gg_tile& t) {
    const int past = t.rows_end - t.row0 - BM;
    return past > 0 && past <= TAIL ? past : 0;
}

template <int BM, int TAIL = 0>
__device__ __forceinline__ gg_tile gg_locate(int tile, const int* first_tile, int experts, const int* counts,
                                             const int* offsets, int col_blocks, int tile_cols) {
    int lo = 0, hi = experts - 1;  // the last expert whose first tile is at or before `tile`
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first_tile[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    int local = tile - first_tile[lo];
    int blocks = gg_row_blocks<BM, TAIL>(counts[lo]);
    int group = local / (GG_GROUP * col_blocks), in_group = local % (GG_GROUP * col_blocks);
    int rows = min(GG_GROUP, blocks - group * GG_GROUP);  // row blocks in this group
    gg_tile t;
    t.expert = lo;
    t.row0 = offsets[lo] + (group * GG_GROUP + in_group % rows) * BM;
    t.rows_end = offsets[lo] + counts[lo];
    t.col0 = (in_group / rows) * tile_cols;
    return t;
}

#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A block's bookkeeping in shared memory, past its ring: each stage's full and empty barriers
// and the tile it belongs to, located (expert -1: no more), every expert's first tile
// (experts + 1), a copy of the counts and row offsets, and the tile a gathering producer
// warpgroup works on.
struct gg_shared {
    u64 *full, *empty;
    gg_tile* stage_tile;
    int *first_tile, *rows_of, *start_of, *claimed;
};

// Lays out `sh` from `at`, initialises the barriers (a full stage: the producer thread's
// arrival and its TMA bytes, and gathering every producer thread's copies, or without
// gathering and with `scale_copies` thread 0's; an empty one: every consumer thread), copies
// the counts and offsets and scans the experts' tiles (BM rows, with TAIL more in an expert's
// last, by `col_blocks` column blocks each) with one warp. Returns the number of tiles, for every thread.
template <int BM, int STAGES, int WGS, int TAIL = 0>
__device__ __forceinline__ int gg_setup(unsigned char* at, gg_shared& sh, bool gather, const int* counts,
                                        const int* offsets, int experts, int col_blocks, bool scale_copies = false) {
    sh.full = (u64*)at;
    sh.empty = sh.full + STAGES;
    sh.stage_tile = (gg_tile*)(sh.empty + STAGES);
    sh.first_tile = (int*)(sh.stage_tile + STAGES);
    sh.rows_of = sh.first_tile + experts + 1;
    sh.start_of = sh.rows_of + experts;
    sh.claimed = sh.start_of + experts;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            gg_bar_init(&sh.full[s], gather ? 1 + 128 : scale_copies ? 2 : 1);
            gg_bar_init(&sh.empty[s], WGS * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        sh.rows_of[e] = counts[e];
        sh.start_of[e] = offsets[e];
    }
    if (threadIdx.x < 32) {
        int acc = 0;
        for (int base = 0; base < experts; base += 32) {
            int e = base + threadIdx.x;
            int n = e < experts ? gg_row_blocks<BM, TAIL>(counts[e]) * col_blocks : 0;
            for (int o = 1; o < 32; o <<= 1) {
                int v = __shfl_up_sync(0xffffffffu, n, o);
                if ((int)threadIdx.x >= o) n += v;
            }
            if (e < experts) sh.first_tile[e + 1] = acc + n;
            acc += __shfl_sync(0xffffffffu, n, 31);
        }
        if (threadIdx.x == 0) sh.first_tile[0] = 0;
    }
    __syncthreads();
    return sh.first_tile[experts];
}

// The producer warpgroup (threads 0 .. 127) of a kernel whose stages are 128 bytes deep (DEPTH
// elements of type T): one thread claims tiles in order from the shared counter (blocks that claim
// neighbouring tiles start them together, so they share weights and rows in L2) and keeps the ring
// full; each stage carries its tile, located (gg_locate), so that the consumers need not search
// for it (docs/tuning.md), and expert -1 once there are none left. A tile is claimed only when its
// first stage is free: claiming one tile ahead (to hide the atomic) left whole tiles waiting
// behind busy blocks at the end (docs/tuning.md). A stage holds BM rows of A (by TMA, or gathered:
// every thread of the warpgroup copies its share with cp.async) and BN weight rows in two boxes of
// BN / 2: the next BN / 2 rows, or with an activation the up rows `width` further down. A tile of
// `subs` sub-tiles (an activation quantized in the epilogue takes two) streams its depth once for
// each, sub-tile s starting BN / 2 weight rows further. With W_SCALES (fp8 weights with one scale
// per 128 × 128 block, w_scales [experts, ceil(N / 128), ceil(K / 128)]) a stage also brings the
// scales of its two boxes' blocks into w_slots[stage] (thread 0, by cp.async, so that the
// consumers never wait on a global load for them; gg_setup's `scale_copies`).
template <typename T, int DEPTH, int BM, int BN, int STAGES, bool W_SCALES = false, int TAIL = 0>
__device__ __forceinline__ void gg_produce(const gg_shared& sh, unsigned char* ring, const gg_tensor_map& a_map,
                                           const gg_tensor_map& w_map, int tiles, int experts, int N, int K,
                                           int width, bool act, int col_blocks, int tile_cols, int* next_tile,
                                           const T* gather_x, long gather_stride, const int* slot_of_row, int gather_k,
                                           int subs, const float* w_scales = nullptr, float2* w_slots = nullptr,
                                           const gg_tensor_map* tail_map = nullptr) {
    // A stage's rows: BM, then room for TAIL more (an expert's last rows, see gg_row_blocks),
    // which TMA brings through tail_map's boxes of TAIL rows.
    constexpr int A_BYTES = (BM + TAIL) * 128, B_BYTES = BN * 128;
    constexpr int ROWS_PER_THREAD = (BM + TAIL) / 16;  // gathering: eight threads a row
    constexpr int CHUNK = 16 / sizeof(T);     // elements a 16-byte copy
    const bool gather = gather_x != 0;
    if (threadIdx.x != 0 && !gather) return;
    const int me = threadIdx.x, kblocks = (K + DEPTH - 1) / DEPTH;
    int stage = 0;
    unsigned phase = 0;
    for (;;) {
        int tile;
        if (gather) {
            if (me == 0) *sh.claimed = atomicAdd(next_tile, 1);
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
            tile = *sh.claimed;
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
        } else {
            tile = atomicAdd(next_tile, 1);
        }
        if (tile >= tiles) {
            // The last block done claiming zeroes the counters for the next launch (every
            // block has made its last claim by then), so the host sets no memset before it.
            if (me == 0) {
                __threadfence();
                if (atomicAdd(next_tile + 1, 1) == (int)gridDim.x - 1) {
                    next_tile[0] = 0;
                    next_tile[1] = 0;
                }
            }
            gg_bar_wait(&sh.empty[stage], phase ^ 1);
            if (me == 0) sh.stage_tile[stage].expert = -1;
            // Gathering, every thread arrives (1 + 128 with thread 0's); with scale copies
            // thread 0 twice.
            gg_bar_arrive(&sh.full[stage]);
            if ((gather || W_SCALES) && me == 0) gg_bar_arrive(&sh.full[stage]);
            return;
        }
        gg_tile t = gg_locate<BM, TAIL>(tile, sh.first_tile, experts, sh.rows_of, sh.start_of, col_blocks, tile_cols);
        // The tile's rows end at BM, or past it where they end the expert (gg_tail_of); the
        // expert's end bounds them too.
        const int tail = gg_tail_of<BM, TAIL>(t), tile_end = min(t.rows_end, t.row0 + BM + tail);
        const int wrow = t.expert * N + t.col0, wrow2 = wrow + (act ? width : BN / 2);
        // Gathering: this thread copies 16-byte chunk me % 8 of rows me / 8 + 16 j of the tile
        // (eight threads a row, so a warp reads four whole 128-byte lines at a time), from the
        // rows' tokens; rows past the tile's end (bit j of `live` clear) are left as they
        // are and dropped. Every row r = me / 8 + 16 j has the same r % 8, so the 128-byte
        // swizzle TMA would apply (chunk c of row r at c ^ (r % 8)) puts this thread's chunk
        // at the same place in each of its rows, 2048 bytes apart.
        const int chunk = me % 8;
        const int to = (me / 8) * 128 + ((chunk ^ ((me / 8) & 7)) << 4);
        const T* src[ROWS_PER_THREAD];
        unsigned live = 0;
#pragma unroll
        for (int j = 0; j < ROWS_PER_THREAD; j++) {
            const int row = t.row0 + me / 8 + 16 * j;
            src[j] = gather_x;
            if (gather && row < tile_end) {
                src[j] += (slot_of_row[row] / gather_k) * gather_stride + CHUNK * chunk;
                live |= 1u << j;
            }
        }
        for (int sub = 0; sub < subs; sub++) {
            for (int kb = 0; kb < kblocks; kb++) {
                gg_bar_wait(&sh.empty[stage], phase ^ 1);
                unsigned char* a = ring + stage * A_BYTES;
                if (me == 0) {
                    sh.stage_tile[stage] = t;
                    gg_bar_expect(&sh.full[stage], (gather ? 0 : (BM + (tail ? TAIL : 0)) * 128) + B_BYTES);
                    if (!gather) gg_tma_load(a, &a_map, &sh.full[stage], kb * DEPTH, t.row0);
                    if (!gather && tail) gg_tma_load(a + BM * 128, tail_map, &sh.full[stage], kb * DEPTH, t.row0 + BM);
                    unsigned char* b = ring + STAGES * A_BYTES + stage * B_BYTES;
                    gg_tma_load(b, &w_map, &sh.full[stage], kb * DEPTH, wrow + sub * BN / 2);
                    gg_tma_load(b + B_BYTES / 2, &w_map, &sh.full[stage], kb * DEPTH, wrow2 + sub * BN / 2);
                    if constexpr (W_SCALES) {
                        const int n_blocks = (N + 127) / 128;
                        // The two boxes' first weight rows within the expert.
                        const int w0 = t.col0 + sub * BN / 2, w1 = w0 + (wrow2 - wrow);
                        const float* at = w_scales + (long)t.expert * n_blocks * kblocks + kb;
                        gg_copy4(&w_slots[stage].x, at + (long)(w0 / 128) * kblocks);
                        gg_copy4(&w_slots[stage].y, at + (long)min(w1 / 128, n_blocks - 1) * kblocks);
                        if (!gather) gg_copies_arrive(&sh.full[stage]);
                    }
                }
                if (gather) {
                    // Columns past K come as zeros (a copy of 0 bytes from the row's start).
                    const bool inside = kb * DEPTH + CHUNK * chunk < K;
                    const int col = inside ? kb * DEPTH : -CHUNK * chunk;
                    const unsigned bytes = inside ? 16 : 0;
#pragma unroll
                    for (int j = 0; j < ROWS_PER_THREAD; j++)
                        if (live >> j & 1) gg_copy16(a + to + 2048 * j, src[j] + col, bytes);
                    gg_copies_arrive(&sh.full[stage]);
                }
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
        }
    }
}

// One tile of gg_kernel's consumer warpgroup wg, its stages from `stage` (phase `phase`; both
// advanced, `last` the stage handed back last), and its epilogue; with TAILED also the `tail`
// rows past BM (gg_tail_of): their products, with the operands swapped, go to the tensor
// cores in the same commit groups, and gg_store_tail writes them. A copy of its own for each
// of TAILED's values, each with sums of its own, so that no wgmma is issued under a condition
// and no sums move between the copies (either makes ptxas serialize every wgmma).
template <int WGS, int STAGES, int BN, int TAIL, bool TAILED, bool SCATTER>
__device__ __forceinline__ void gg_consume_tile(const gg_tile& t, int tail, int wg, unsigned char* ring, u64* full,
                                                u64* empty, int& stage, unsigned& phase, int& last, int kblocks,
                                                bool gather, gg_out<SCATTER> C, int N, int width, int act_kind,
                                                const float* b13, float alpha, float limit) {
    constexpr int BM = 64 * WGS;
    constexpr int A_BYTES = (BM + TAIL) * GG_BK * 2, B_BYTES = BN * GG_BK * 2;
    const bool act = act_kind >= 0;
    float d[BN / 2];
    float e[TAILED ? 32 : 1];  // the tail's sums: two m64n32 fragments
    for (int kb = 0; kb < kblocks; kb++) {
        if (kb > 0) gg_bar_wait(&full[stage], phase);
        // Rows gathered by cp.async were written through the generic proxy; wgmma
        // reads through the async one.
        if (gather) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        u64 da = gg_desc(ring + stage * A_BYTES + wg * 64 * 128);
        u64 db = gg_desc(ring + STAGES * A_BYTES + stage * B_BYTES);
        gg_fence();
#pragma unroll
        for (int kk = 0; kk < GG_BK / 16; kk++) {
            if constexpr (BN == 256) gg_mma(d, da + 2 * kk, db + 2 * kk, kb > 0 || kk > 0);
            else gg_mma224(d, da + 2 * kk, db + 2 * kk, kb > 0 || kk > 0);
        }
        if constexpr (TAILED) {
            // The tail's rows as B (32 of them from BM), this warpgroup's two weight
            // boxes as A (64 rows of 128 bytes each: 512 descriptor units).
            const u64 dt = gg_desc(ring + stage * A_BYTES + BM * 128);
#pragma unroll
            for (int kk = 0; kk < GG_BK / 16; kk++) {
                gg_mma32(e, db + 512 * wg + 2 * kk, dt + 2 * kk, kb > 0 || kk > 0);
                gg_mma32(e + 16, db + 512 * (wg + 2) + 2 * kk, dt + 2 * kk, kb > 0 || kk > 0);
            }
        }
        gg_commit();
        // The previous stage's products are done once at most this one is in flight.
        if (kb > 0) {
            gg_wait<1>();
            gg_bar_arrive(&empty[last]);
        }
        last = stage;
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
    }
    gg_wait<0>();
    gg_pin<BN / 2>(d);
    if constexpr (TAILED) gg_pin<32>(e);
    gg_bar_arrive(&empty[last]);
    if constexpr (TAILED)
        gg_store_tail(e, C, t.row0 + BM, tail, t.col0, width, wg, act_kind,
                      act && b13 ? b13 + (long)t.expert * N : 0, alpha, limit);
    // Activations run in 256-column tiles only (the host sees to it); their 128 output
    // columns are d[0 .. 63].
    const long row0 = t.row0 + wg * 64;
    if constexpr (BN == 256) {
        if (act) {
            gg_act_kind<16>(d, act_kind, b13 ? b13 + (long)t.expert * N : 0, t.col0, width, alpha, limit);
            gg_store_to<128>(d, C, row0, t.rows_end, t.col0, width);
            return;
        }
    }
    gg_store_to<BN>(d, C, row0, t.rows_end, t.col0, width);
}

// The kernel for tiles of 64·WGS rows (WGS consumer warpgroups after the producer one) over a
// ring of STAGES stages; see the entry points below for the arguments.
template <int WGS, int STAGES, int BN, int TAIL, bool SCATTER>
__device__ __forceinline__ void gg_kernel(const gg_tensor_map& a_map, const gg_tensor_map& w_map,
                                          const gg_tensor_map& tail_map, gg_out<SCATTER> C, const int* counts,
                                          const int* offsets, int experts, int N, int K, int* next_tile, int act_kind,
                                          float alpha, float limit, const float* b13, const bf16_t* gather_x,
                                          const int* slot_of_row, int gather_k, long gather_stride) {
    static_assert(TAIL == 0 || (TAIL == 32 && WGS == 2 && BN == 256), "a tail is one m64n32 fragment a weight box");
    constexpr int BM = 64 * WGS;                  // rows of a tile
    constexpr int A_BYTES = (BM + TAIL) * GG_BK * 2;  // 8 KiB a warpgroup, and room for a tail
    constexpr int B_BYTES = BN * GG_BK * 2;       // 32 KiB at 256 columns
    constexpr int RING_BYTES = STAGES * (A_BYTES + B_BYTES);
    extern __shared__ unsigned char gg_raw[];
    // The ring starts 1024-aligned (the swizzle pattern repeats every 1024 bytes).
    unsigned char* ring = gg_raw + ((1024 - (gg_smem(gg_raw) & 1023)) & 1023);
    const bool gather = gather_x != 0;
    // An activation tile covers BN / 2 output columns: its gate rows and their up rows.
    const bool act = act_kind >= 0;
    const int width = act ? N / 2 : N, tile_cols = act ? BN / 2 : BN;
    const int col_blocks = (width + tile_cols - 1) / tile_cols, kblocks = (K + GG_BK - 1) / GG_BK;
    gg_shared sh;
    const int tiles =
        gg_setup<BM, STAGES, WGS, TAIL>(ring + RING_BYTES, sh, gather, counts, offsets, experts, col_blocks);
    u64 *full = sh.full, *empty = sh.empty;
    const gg_tile* stage_tile = sh.stage_tile;
    // With tails, each consumer thread holds 32 tail sums beside its 128 accumulators: the
    // producer warpgroup hands them registers (at 64 it gathers its ten rows a thread without
    // spilling).
    constexpr int PRODUCER_REGS = 64;
    constexpr int CONSUMER_REGS = (65536 / (128 * (WGS + 1)) / 8 * 8 * (WGS + 1) - PRODUCER_REGS) / WGS / 8 * 8;
    if (threadIdx.x < 128) {
        if constexpr (TAIL > 0) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
        gg_produce<bf16_t, GG_BK, BM, BN, STAGES, false, TAIL>(sh, ring, a_map, w_map, tiles, experts, N, K, width, act,
                                                               col_blocks, tile_cols, next_tile, gather_x,
                                                               gather_stride, slot_of_row, gather_k, 1, nullptr,
                                                               nullptr, &tail_map);
        return;
    }
    if constexpr (TAIL > 0) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");

    // Consumers: warpgroup wg multiplies rows 64·wg .. 64·wg + 63 of each tile, and with a
    // tail its rows against weight rows 64·wg .. and 128 + 64·wg .. (gg_store_tail).
    const int wg = threadIdx.x / 128 - 1;
    int stage = 0, last = 0;
    unsigned phase = 0;
    for (;;) {
        gg_bar_wait(&full[stage], phase);
        const gg_tile t = stage_tile[stage];
        if (t.expert < 0) return;
        // A warpgroup whose 64 rows all lie past the expert's end only hands the stages back.
        if (t.row0 + wg * 64 >= t.rows_end) {
            for (int kb = 0; kb < kblocks; kb++) {
                if (kb > 0) gg_bar_wait(&full[stage], phase);
                gg_bar_arrive(&empty[stage]);
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
            continue;
        }
        const int tail = TAIL > 0 ? gg_tail_of<BM, TAIL>(t) : 0;
        // The tile, with or without a tail's products: two copies of it (gg_consume_tile).
        if (tail)
            gg_consume_tile<WGS, STAGES, BN, TAIL, (TAIL > 0), SCATTER>(t, tail, wg, ring, full, empty, stage, phase,
                                                                       last, kblocks, gather, C, N, width, act_kind,
                                                                       b13, alpha, limit);
        else
            gg_consume_tile<WGS, STAGES, BN, TAIL, false, SCATTER>(t, 0, wg, ring, full, empty, stage, phase, last,
                                                                  kblocks, gather, C, N, width, act_kind, b13, alpha,
                                                                  limit);
    }
}
#endif

// The entry points: `name`, launched with `threads` threads (128 per warpgroup), runs
// gg_kernel<WGS, STAGES, BN, TAIL, SCATTER>. Each computes C[r] = A[r] · W[e]ᵀ, C [rows, N] (act_kind <
// 0), or its activation, C [rows, N / 2], with the kinds, alpha and limit of act_mul and the
// f32 bias b13 [experts, N] (null: none); A is read in boxes of the tile's rows (a_map) and of
// TAIL rows (tail_map, read only where TAIL > 0), W in boxes of half its columns; next_tile is
// two ints, zero at the launch (the tile counter and the blocks done claiming), which the
// kernel leaves zero. With gather_x, row r of A is row slot_of_row[r] / gather_k of gather_x,
// whose rows of K values (16-byte aligned) start gather_stride values apart (the permute's
// gather done by the producer warpgroup's cp.async copies), and neither A map is read. With
// SCATTER, row r goes to the address out_rows[r] instead of C's row r (each row's own, which
// may lie in a peer GPU's memory).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GG_BODY(WGS, STAGES, BN, TAIL, SCATTER)                                                                \
    gg_kernel<WGS, STAGES, BN, TAIL, SCATTER>(a_map, w_map, tail_map, gg_out<SCATTER>{C, out_rows}, counts,     \
                                              offsets, experts, N, K, next_tile, act_kind, alpha, limit, b13,    \
                                              gather_x, slot_of_row, gather_k, gather_stride);
#else
#define GG_BODY(WGS, STAGES, BN, TAIL, SCATTER)
#endif
#define GG_ENTRY(name, threads, WGS, STAGES, BN, TAIL, SCATTER)                                                    \
    extern "C" __global__ void __launch_bounds__(threads, 1)                                                       \
        name(const __grid_constant__ gg_tensor_map a_map, const __grid_constant__ gg_tensor_map w_map,             \
             const __grid_constant__ gg_tensor_map tail_map, bf16_t* C, const int* counts, const int* offsets,    \
             int experts, int N, int K, int* next_tile, int act_kind, float alpha, float limit, const float* b13, \
             const bf16_t* gather_x, const int* slot_of_row, int gather_k, long gather_stride,                    \
             const u64* out_rows) {                                                                               \
        GG_BODY(WGS, STAGES, BN, TAIL, SCATTER)                                                                    \
    }

// 128 × 256 tiles over a 4-stage ring, two consumer warpgroups; an expert's last tile takes up
// to 32 rows past its 128 (GG_TAIL) rather than a tile of their own.
#define GG_TAIL 32
GG_ENTRY(grouped_gemm_sm90, 384, 2, 4, 256, GG_TAIL, false)

// The same, each output row stored at its own address (deterministic mode's down projection
// writing each slot's row straight into its home's window).
GG_ENTRY(grouped_gemm_sm90_scatter, 384, 2, 4, 256, GG_TAIL, true)

// 64 × 256 tiles, one consumer warpgroup and a 5-stage ring: for batches of a few rows an
// expert, whose tiles only stream weights, more of them in flight.
GG_ENTRY(grouped_gemm_sm90_short, 256, 1, 5, 256, 0, false)

// 64 × 224 tiles, products only: a projection 7168 wide over the 8 experts of one token makes
// 256 such tiles, two for nearly every one of 132 SMs, where 256-column tiles make 224 (1.7 a
// SM).
GG_ENTRY(grouped_gemm_sm90_short224, 256, 1, 5, 224, 0, false)
