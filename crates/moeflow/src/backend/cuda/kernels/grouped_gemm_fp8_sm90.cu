// moeflow's fp8 Hopper grouped GEMM: C[r] = A[r] · W[e]ᵀ for every row r of expert e, A and W
// fp8 e4m3 codes with DeepSeek-V3's scales (A: one f32 scale per row and 128 columns of K; W:
// one per 128 × 128 block), C bf16, over all the experts in one persistent launch that reads
// the expert counts and row offsets on the device, as the bf16 kernel in grouped_gemm_sm90.cu
// does (same tile order, counter, producer and store; an activation in the up projection's
// epilogue; rows gathered by the producer from the tokens' codes, which the layer does below
// 128 rows an expert: above, it copies them in expert order first, gather_fp8_rows).
//
// A stage is 128 codes deep: one 128-byte swizzle row, and exactly one scale block of both
// operands. The consumer warpgroups multiply it with four wgmma.m64n128k32 e4m3 into partial
// sums of their own, and add those to the f32 accumulators scaled by the row's and the weight
// block's scales: the tensor cores' fp8 sums carry fewer bits than f32, so they never run
// longer than 128 products (DeepSeek-V3's "promotion"). In 128-row tiles two sets of partial
// sums take turns, so the tensor cores multiply the next block while the last one is scaled
// in. Tiles are 64·WGS rows (WGS consumer warpgroups: two, or one in the short entry
// points) by 128 weight rows (two boxes of 64: the next 64 rows, or the gate rows and their up
// rows, which then give 64 output columns), so a thread holds 64 accumulators and one or two
// sets of 64 partial sums; with two sets, and where two blocks share an SM, the producer
// warpgroup hands the consumers its registers (setmaxnreg). The decode entry point takes
// tiles of 16 rows and multiplies each stage with the operands swapped (g8_decode_tile); the
// 128-row tiles run an expert's last tile that way too where it holds at most 32 rows.
// (Compiled after grouped_gemm_sm90.cu, whose helpers it uses.)

#define G8_BK 128  // codes a stage deep: 128 bytes, one swizzle row, one scale block
#define G8_BN 128  // weight rows a tile

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define G8_D8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])

// d[64 × 128 fragment] (+)= A[64 × 32] · B[128 × 32]ᵀ, e4m3 codes from shared memory at the
// descriptors whose low words are a and b (high words GG_DESC_HI), f32 sums; `accumulate` 0
// overwrites d.
__device__ __forceinline__ void g8_mma(float* d, unsigned a, unsigned b, int accumulate) {
    asm volatile(
        "{\n .reg .pred acc;\n .reg .b64 da, db;\n setp.ne.b32 acc, %66, 0;\n"
        "mov.b64 da, {%64, %67};\n mov.b64 db, {%65, %67};\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, da, db, acc, 1, 1;\n}\n"
        : G8_D8(0), G8_D8(8), G8_D8(16), G8_D8(24), G8_D8(32), G8_D8(40), G8_D8(48), G8_D8(56)
        : "r"(a), "r"(b), "r"(accumulate), "n"(GG_DESC_HI));
}

// d[64 × 16 fragment] (+)= A[64 × 32] · B[16 × 32]ᵀ, as g8_mma over 16 columns.
__device__ __forceinline__ void g8_mma16(float* d, unsigned a, unsigned b, int accumulate) {
    asm volatile(
        "{\n .reg .pred acc;\n .reg .b64 da, db;\n setp.ne.b32 acc, %10, 0;\n"
        "mov.b64 da, {%8, %11};\n mov.b64 db, {%9, %11};\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, da, db, acc, 1, 1;\n}\n"
        : G8_D8(0)
        : "r"(a), "r"(b), "r"(accumulate), "n"(GG_DESC_HI));
}

// Four wgmma over the 128-deep block whose A and B tiles have descriptor low words a and b
// (gg_desc_lo) into p (overwritten), one commit group.
__device__ __forceinline__ void g8_issue(float* p, unsigned a, unsigned b, bool gather) {
    // Rows gathered by cp.async were written through the generic proxy; wgmma reads through
    // the async one.
    if (gather) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    gg_fence();
#pragma unroll
    for (int kk = 0; kk < G8_BK / 32; kk++) g8_mma(p, a + 2 * kk, b + 2 * kk, kk > 0);
    gg_commit();
}

// A block's scales: this thread's two rows' (fa, fb) and the tile's two weight blocks' (f0, f1).
struct g8_scales {
    float fa, fb, f0, f1;
};

// d += p scaled by s: p[4j + {0,1}] is row r0, p[4j + {2,3}] row r0 + 8; groups j < 8 the
// first half of the tile's weight rows.
__device__ __forceinline__ void g8_promote(float* d, const float* p, g8_scales s) {
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const float w = j < 8 ? s.f0 : s.f1;
        d[4 * j] += p[4 * j] * (s.fa * w);
        d[4 * j + 1] += p[4 * j + 1] * (s.fa * w);
        d[4 * j + 2] += p[4 * j + 2] * (s.fb * w);
        d[4 * j + 3] += p[4 * j + 3] * (s.fb * w);
    }
}

// The activation's values of a 128-column group quantized in the epilogue, for the down
// projection: `lo` and `hi` hold this thread's bf16 pairs of the group's two 64-column halves
// (pair 2j + h: row r0 + 8h, columns 8j + 2q + {0,1} of the half, q = lane % 4), the four
// lanes of a quad one row's 128 values between them. Writes their fp8 codes to Q [·, width]
// and the group's scale (amax / 448, as quantize_rows_bf16 computes it, so the codes are
// bit for bit the separate pass's) to S [·, width / 128], rows below `rows_end` only. The
// codes go out 8 bytes a lane: the quad trades its code pairs of four column groups (a 4 × 4
// transpose in four shuffles), so that each lane holds 8 consecutive codes of one group.
__device__ __forceinline__ void g8_store_fp8(const unsigned* lo, const unsigned* hi, unsigned char* Q, float* S,
                                             long r0, int rows_end, int col0, int width) {
    const int q = threadIdx.x % 4, quad = (threadIdx.x % 32) & ~3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const unsigned l = lo[2 * j + h], u = hi[2 * j + h];
            a = fmaxf(a, fmaxf(fmaxf(fabsf(__uint_as_float(l << 16)), fabsf(__uint_as_float(l & 0xffff0000u))),
                               fmaxf(fabsf(__uint_as_float(u << 16)), fabsf(__uint_as_float(u & 0xffff0000u)))));
        }
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
        const float sc = group_scale(a, 2), y = 1.0f / sc;
        const bool products = quotients_by_fma(sc);
        const long r = r0 + 8 * h;
        const bool here = r < rows_end;
        if (here && q == 0) S[r * (width / 128) + col0 / 128] = sc;
        unsigned char* row = Q + r * width + col0;
#pragma unroll
        for (int half = 0; half < 2; half++) {
#pragma unroll
            for (int jb = 0; jb < 8; jb += 4) {
                // This lane's code pairs (columns 8j + 2q, + 1) of groups jb .. jb + 3.
                unsigned code[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const unsigned v = (half ? hi : lo)[2 * (jb + u) + h];
                    const float v0 = __uint_as_float(v << 16), v1 = __uint_as_float(v & 0xffff0000u);
                    code[u] = group_code(v0, sc, y, products, 2) | (group_code(v1, sc, y, products, 2) << 8);
                }
                // Round t: lane s sends its pair of group jb + (s - t) % 4 and takes lane
                // (q + t) % 4's pair of group jb + q, its bytes 2 ((q + t) % 4) of that group.
                unsigned long long word = 0;
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    const int give = (q - t) & 3, from = (q + t) & 3;
                    const unsigned send = give == 0 ? code[0] : give == 1 ? code[1] : give == 2 ? code[2] : code[3];
                    const unsigned got = __shfl_sync(0xffffffffu, send, quad | from);
                    word |= (unsigned long long)(got & 0xffffu) << (16 * from);
                }
                if (here) *(unsigned long long*)(row + 64 * half + 8 * (jb + q)) = word;
            }
        }
    }
}

// One decode tile of up to 16 rows of an expert by 128 weight rows (tile t, its first stage
// waited for), by one warpgroup, its products run with the operands swapped: each 64-row
// weight box as wgmma's rows and the tile's rows as its 16 columns (m64n16k32), so that a
// thread holds 8 partial sums and 8 accumulators a box where the 64-row tiles hold 64 of each.
// Each output is the same sum of the same products in the same order as in the other tiles.
// Fragment: register x of a box is weight row 16·warp + lane/4 + 8·((x >> 1) & 1) of the box
// and tile row 8·(x >> 2) + 2·(lane % 4) + (x & 1). A tile's weight boxes are its next 64
// weight rows each, or with an activation its gate rows and their up rows. The rows are the
// first 16 of each stage's row tile (rows_desc, A_BYTES a stage), the weights the stage's
// weight tile (w_desc); the weight scales come with the stage (STAGED, w_slots) or from
// `scale_w0` and `scale_w1` (a block each). Hands each stage back and advances `stage`.
template <int STAGES, int A_BYTES, bool STAGED>
__device__ __forceinline__ void g8_decode_tile(const gg_shared& sh, const gg_tile& t, int& stage, unsigned& phase,
                                               unsigned rows_desc, unsigned w_desc, bf16_t* C, int N, int kblocks,
                                               int width, bool act, int act_kind, float alpha, float limit,
                                               const float* b13, const float* a_scales, const float2* w_slots,
                                               const float* scale_w0, const float* scale_w1, bool gather,
                                               const int* slot_of_row, int gather_k) {
    constexpr int B_BYTES = G8_BN * G8_BK;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, q = lane % 4;
    float d0[8], d1[8], p0[8], p1[8];
    // The scales of this thread's four tile rows, 2q, 2q + 1, 2q + 8 and 2q + 9 (rows past the
    // expert's end read its last row's; their sums are dropped).
    const float* sa[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = min(t.row0 + 8 * (i >> 1) + 2 * q + (i & 1), t.rows_end - 1);
        sa[i] = a_scales + (slot_of_row ? (long)(slot_of_row[r] / gather_k) : (long)r) * kblocks;
    }
    float s[4], ahead[4];
#pragma unroll
    for (int i = 0; i < 4; i++) s[i] = sa[i][0];
#pragma unroll
    for (int x = 0; x < 8; x++) d0[x] = d1[x] = 0.0f;
    for (int kb = 0; kb < kblocks; kb++) {
        if (kb > 0) gg_bar_wait(&sh.full[stage], phase);
        const int st = __shfl_sync(0xffffffffu, stage, 0);  // one value a warp
        const unsigned rd = rows_desc + st * (A_BYTES / 16), wd = w_desc + st * (B_BYTES / 16);
        if (gather) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        gg_fence();
#pragma unroll
        for (int kk = 0; kk < G8_BK / 32; kk++) {
            g8_mma16(p0, wd + 2 * kk, rd + 2 * kk, kk > 0);
            g8_mma16(p1, wd + (B_BYTES / 2) / 16 + 2 * kk, rd + 2 * kk, kk > 0);
        }
        gg_commit();
        const float2 w = STAGED ? w_slots[stage] : make_float2(scale_w0[kb], scale_w1[kb]);
        const int kn = min(kb + 1, kblocks - 1);
#pragma unroll
        for (int i = 0; i < 4; i++) ahead[i] = sa[i][kn];
        gg_wait<0>();
        gg_pin<8>(p0);
        gg_pin<8>(p1);
        gg_bar_arrive(&sh.empty[stage]);
#pragma unroll
        for (int x = 0; x < 8; x++) {
            const float f = s[2 * (x >> 2) + (x & 1)];
            d0[x] += p0[x] * (f * w.x);
            d1[x] += p1[x] * (f * w.y);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) s[i] = ahead[i];
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
    }
    const float* bias = b13 ? b13 + (long)t.expert * N : 0;
#pragma unroll
    for (int x = 0; x < 8; x++) {
        const long row = t.row0 + 8 * (x >> 2) + 2 * q + (x & 1);
        const int col = t.col0 + 16 * warp + lane / 4 + 8 * ((x >> 1) & 1);
        if (row >= t.rows_end) continue;
        if (act) {
            float g = d0[x], u = d1[x];
            if (bias) {
                const int c = min(col, width - 1);
                g += bias[c];
                u += bias[width + c];
            }
            const float v = act_mul(g, u, act_kind, alpha, limit);
            if (col < width) C[row * width + col] = (bf16_t)(gg_pack(v, 0.0f) & 0xffffu);
        } else {
            if (col < width) C[row * width + col] = (bf16_t)(gg_pack(d0[x], 0.0f) & 0xffffu);
            if (col + 64 < width) C[row * width + col + 64] = (bf16_t)(gg_pack(d1[x], 0.0f) & 0xffffu);
        }
    }
}

// The consumer warpgroups of g8_kernel: warpgroup wg multiplies rows 64·wg .. 64·wg + 63 of
// each tile, and hands each stage back to the producer; in 128-row tiles without QUANT, a tile
// of at most 32 rows goes as two decode tiles, rows 16·wg .. 16·wg + 15. With SETS 2 two sets
// of partial sums take turns: a block's products run on the tensor cores while the block
// before is scaled into the accumulators (the loop goes two blocks a turn, so each set keeps
// its registers); with SETS 1 each block's products are waited for, then scaled in. With QUANT
// (an activation quantized in the epilogue, into Q and S) a tile is two sub-tiles of 64 output
// columns, one after the other: the first's activation waits in registers, as bf16 pairs, for
// the second's.
template <int WGS, int STAGES, int SETS, bool QUANT, bool STAGED>
__device__ __forceinline__ void g8_consume(const gg_shared& sh, unsigned char* ring, bf16_t* C, int N, int K,
                                           int width, bool act, int act_kind, float alpha, float limit,
                                           const float* b13, const float* a_scales, const float* w_scales,
                                           const float2* w_slots, bool gather, const int* slot_of_row, int gather_k,
                                           unsigned char* Q, float* S) {
    constexpr int BM = 64 * WGS;             // rows of a tile
    constexpr int A_BYTES = BM * G8_BK;      // 8 KiB a warpgroup
    constexpr int B_BYTES = G8_BN * G8_BK;   // 16 KiB
    const int kblocks = (K + G8_BK - 1) / G8_BK;
    const int n_blocks = (N + 127) / 128;  // weight scale blocks down an expert
    constexpr int subs = QUANT ? 2 : 1;
    constexpr bool DECODE_TAILS = WGS == 2 && !QUANT;
    // The warpgroup's index from lane 0, so that the compiler knows it is one value a warp and
    // keeps the descriptors below in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    // Descriptor low words of stage 0's rows (this warpgroup's 64 at a_desc) and weight rows.
    const unsigned rows_desc = gg_desc_lo(ring), b_desc = gg_desc_lo(ring + STAGES * A_BYTES);
    const unsigned a_desc = rows_desc + wg * (64 * G8_BK / 16);
    float d[64], p0[64], p1[64];
    unsigned held[16];
    int stage = 0;
    unsigned phase = 0;
    auto next = [&]() {
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
    };
    auto issue = [&](float* into) {
        const int s = __shfl_sync(0xffffffffu, stage, 0);  // one value a warp, as for wg
        g8_issue(into, a_desc + s * (A_BYTES / 16), b_desc + s * (B_BYTES / 16), gather);
    };
    // The block scales (a float a block) of tile t's weight box `box` (0: the weight rows from
    // output column col0; 1: the next 64 rows, or with an activation their up rows).
    auto weight_scales = [&](const gg_tile& t, int col0, int box) {
        const int wn = col0 + box * (act ? width : G8_BN / 2);
        return w_scales + ((long)t.expert * n_blocks + min(wn / 128, n_blocks - 1)) * kblocks;
    };
    for (;;) {
        gg_bar_wait(&sh.full[stage], phase);
        const gg_tile t = sh.stage_tile[stage];
        if (t.expert < 0) return;
        // A tile of at most 32 rows (an expert's last) runs as two decode tiles, warpgroup wg
        // taking rows 16·wg .. 16·wg + 15: a quarter or half of one warpgroup's 64-row
        // products, and the same sums.
        const bool tail = DECODE_TAILS && t.rows_end - t.row0 <= 32;
        // A warpgroup whose rows all lie past the expert's end only hands the stages back.
        if (t.row0 + wg * (tail ? 16 : 64) >= t.rows_end) {
            for (int kb = 0; kb < subs * kblocks; kb++) {
                if (kb > 0) gg_bar_wait(&sh.full[stage], phase);
                gg_bar_arrive(&sh.empty[stage]);
                next();
            }
            continue;
        }
        if constexpr (DECODE_TAILS) {
            if (tail) {
                gg_tile half = t;
                half.row0 += 16 * wg;
                g8_decode_tile<STAGES, A_BYTES, false>(
                    sh, half, stage, phase, rows_desc + wg * (16 * G8_BK / 16), b_desc, C, N, kblocks, width, act,
                    act_kind, alpha, limit, b13, a_scales, w_slots, weight_scales(t, t.col0, 0),
                    weight_scales(t, t.col0, 1), gather, slot_of_row, gather_k);
                continue;
            }
        }
        // This thread's two rows' scales (rows past the expert's end read its last row's;
        // their sums are dropped).
        const int r0 = t.row0 + wg * 64 + warp * 16 + lane / 4;
        const int ra = min(r0, t.rows_end - 1), rb = min(r0 + 8, t.rows_end - 1);
        const long sa = gather ? (long)(slot_of_row[ra] / gather_k) : ra;
        const long sb = gather ? (long)(slot_of_row[rb] / gather_k) : rb;
        const float* scale_a = a_scales + sa * kblocks;
        const float* scale_b = a_scales + sb * kblocks;
        const long row0 = t.row0 + wg * 64;
        for (int sub = 0; sub < subs; sub++) {
            if (sub > 0) gg_bar_wait(&sh.full[stage], phase);
            const int col0 = t.col0 + 64 * sub;
            const float *scale_w0 = weight_scales(t, col0, 0), *scale_w1 = weight_scales(t, col0, 1);
            // Block kb's scales from global memory, a block ahead of their use; STAGED, the
            // weights' come with the stage instead (w_slots, read as its products are issued).
            auto scales = [&](int kb) {
                if constexpr (STAGED) return g8_scales{scale_a[kb], scale_b[kb], 0.0f, 0.0f};
                return g8_scales{scale_a[kb], scale_b[kb], scale_w0[kb], scale_w1[kb]};
            };
#pragma unroll
            for (int j = 0; j < 64; j++) d[j] = 0.0f;
            int held_stage = stage;  // the stage of the block in flight longest
            float2 held_w;           // STAGED: its weight scales
            auto weights_of = [&](g8_scales s) {
                if constexpr (STAGED) s.f0 = held_w.x, s.f1 = held_w.y;
                return s;
            };
            auto staged = [&]() { return STAGED ? w_slots[stage] : float2{}; };
            auto step = [&](float* into, float* done, g8_scales s) {
                gg_bar_wait(&sh.full[stage], phase);
                issue(into);
                const float2 w = staged();
                gg_wait<1>();
                gg_pin<64>(done);
                gg_bar_arrive(&sh.empty[held_stage]);
                g8_promote(d, done, weights_of(s));
                held_stage = stage;
                held_w = w;
                next();
            };
            auto last = [&](float* done, g8_scales s) {
                gg_wait<0>();
                gg_pin<64>(done);
                gg_bar_arrive(&sh.empty[held_stage]);
                g8_promote(d, done, weights_of(s));
            };
            if constexpr (SETS == 2) {
                // Block 0 into p0; then each turn, with block kb in flight in p0, block kb + 1
                // goes into p1 while p0 is scaled in, and block kb + 2 into p0 while p1 is. The
                // last one or two blocks follow the loop, so every path leaves the same set in
                // flight.
                issue(p0);
                held_w = staged();
                next();
                int kb = 0;
                for (; kb + 2 < kblocks; kb += 2) {
                    step(p1, p0, scales(kb));
                    step(p0, p1, scales(kb + 1));
                }
                if (kb + 1 < kblocks) {
                    step(p1, p0, scales(kb));
                    last(p1, scales(kb + 1));
                } else {
                    last(p0, scales(kb));
                }
            } else {
                // One set: each block's products, waited for, then scaled in. The next block's
                // scales are loaded while this one multiplies, a block ahead of their use.
                g8_scales s = scales(0);
                for (int kb = 0; kb < kblocks; kb++) {
                    if (kb > 0) gg_bar_wait(&sh.full[stage], phase);
                    issue(p0);
                    held_w = staged();
                    const g8_scales ahead = scales(min(kb + 1, kblocks - 1));
                    held_stage = stage;
                    last(p0, s);
                    s = ahead;
                    next();
                }
            }
            if (!act) {
                gg_store<128>(d, C, row0, t.rows_end, col0, width);
                continue;
            }
            gg_act_kind<8>(d, act_kind, b13 ? b13 + (long)t.expert * N : 0, col0, width, alpha, limit);
            if constexpr (QUANT) {
                unsigned now[16];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    now[2 * j] = gg_pack(d[4 * j], d[4 * j + 1]);
                    now[2 * j + 1] = gg_pack(d[4 * j + 2], d[4 * j + 3]);
                }
                if (sub == 0) {
#pragma unroll
                    for (int j = 0; j < 16; j++) held[j] = now[j];
                } else {
                    g8_store_fp8(held, now, Q, S, r0, t.rows_end, t.col0, width);
                }
            } else {
                gg_store<64>(d, C, row0, t.rows_end, col0, width);
            }
        }
    }
}

// The consumer warpgroup of the decode tiles (g8_kernel with DECODE): tiles of up to 16 rows
// (g8_decode_tile), their weight scales staged with the ring. At a few rows an expert the
// 64-row tiles' products and their scaling in held the stages back from the producer
// (docs/tuning.md).
template <int STAGES>
__device__ __forceinline__ void g8_consume_decode(const gg_shared& sh, unsigned char* ring, bf16_t* C, int N,
                                                  int K, int width, bool act, int act_kind, float alpha, float limit,
                                                  const float* b13, const float* a_scales, const float2* w_slots,
                                                  bool gather, const int* slot_of_row, int gather_k) {
    constexpr int BM = 16, A_BYTES = BM * G8_BK;
    const int kblocks = (K + G8_BK - 1) / G8_BK;
    // Descriptor low words of stage 0's tile rows and first weight box.
    const unsigned rows_desc = gg_desc_lo(ring), w_desc = gg_desc_lo(ring + STAGES * A_BYTES);
    int stage = 0;
    unsigned phase = 0;
    for (;;) {
        gg_bar_wait(&sh.full[stage], phase);
        const gg_tile t = sh.stage_tile[stage];
        if (t.expert < 0) return;
        g8_decode_tile<STAGES, A_BYTES, true>(sh, t, stage, phase, rows_desc, w_desc, C, N, kblocks, width, act,
                                              act_kind, alpha, limit, b13, a_scales, w_slots, nullptr, nullptr,
                                              gather, slot_of_row, gather_k);
    }
}

// The kernel for tiles of 64·WGS rows (16 with DECODE, g8_consume_decode's) over a ring of
// STAGES stages, SETS sets of partial sums, QUANT for an activation quantized in the epilogue;
// see the entry points below.
template <int WGS, int STAGES, int SETS, bool QUANT, int BLOCKS, bool DECODE>
__device__ __forceinline__ void g8_kernel(const gg_tensor_map& a_map, const gg_tensor_map& w_map, bf16_t* C,
                                          const int* counts, const int* offsets, int experts, int N, int K,
                                          int* next_tile, int act_kind, float alpha, float limit, const float* b13,
                                          const float* a_scales, const float* w_scales,
                                          const unsigned char* gather_x, const int* slot_of_row, int gather_k,
                                          unsigned char* Q, float* S) {
    constexpr int BM = DECODE ? 16 : 64 * WGS;
    constexpr int RING_BYTES = STAGES * (BM + G8_BN) * G8_BK;
    extern __shared__ unsigned char g8_raw[];
    unsigned char* ring = g8_raw + ((1024 - (gg_smem(g8_raw) & 1023)) & 1023);
    // 64-row tiles take each block's weight scales with its stage (two floats a stage, past the
    // ring), brought by the producer, where the consumer loaded them from global memory a block
    // ahead: about 2 % of a one-token W8A8 layer. 128-row tiles still load them, which was
    // faster there (docs/tuning.md).
    constexpr bool STAGED = WGS == 1;
    float2* w_slots = (float2*)(ring + RING_BYTES);
    const bool gather = gather_x != 0;
    const bool act = act_kind >= 0;
    // An activation quantized in the epilogue takes tiles of two sub-tiles: 128 output
    // columns, one scale group of the down projection's rows.
    const int width = act ? N / 2 : N, tile_cols = act ? (QUANT ? G8_BN : G8_BN / 2) : G8_BN;
    const int col_blocks = (width + tile_cols - 1) / tile_cols;
    gg_shared sh;
    const int tiles =
        gg_setup<BM, STAGES, WGS>(ring + RING_BYTES + STAGES * sizeof(float2), sh, gather, counts, offsets, experts,
                                  col_blocks, STAGED);
    // Two consumer warpgroups hold 192 sums a thread (the accumulators and two sets of
    // partial sums), or 128 and a sub-tile's activation: the producer warpgroup gives them
    // registers. The block holds 168 a thread (384 threads), 128 · P + 256 · C of them: the
    // producer keeps 56 (P) beside two sets, the consumers 224 (at 40 the producer spilled,
    // and both projections ran slower; docs/tuning.md); beside the quantizing tiles, whose
    // consumers need fewer, it keeps 88. Two blocks an SM of 256 threads hold 128 a thread:
    // the producer keeps 56 there too, the consumer 200.
    constexpr bool SHIFT_REGISTERS = (WGS == 2 && (SETS == 2 || QUANT)) || BLOCKS == 2;
    constexpr int BUDGET = 65536 / (128 * (WGS + 1) * BLOCKS) / 8 * 8;  // a thread's registers at launch
    constexpr int PRODUCER_REGS = QUANT ? 88 : 56;
    constexpr int CONSUMER_REGS = (BUDGET * (WGS + 1) - PRODUCER_REGS) / WGS / 8 * 8;
    if (threadIdx.x < 128) {
        if constexpr (SHIFT_REGISTERS)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
        gg_produce<unsigned char, G8_BK, BM, G8_BN, STAGES, STAGED>(sh, ring, a_map, w_map, tiles, experts, N, K,
                                                                    width, act, col_blocks, tile_cols, next_tile,
                                                                    gather_x, (long)K, slot_of_row, gather_k,
                                                                    QUANT ? 2 : 1, w_scales, w_slots);
    } else if constexpr (DECODE) {
        g8_consume_decode<STAGES>(sh, ring, C, N, K, width, act, act_kind, alpha, limit, b13, a_scales, w_slots,
                                  gather, slot_of_row, gather_k);
    } else {
        if constexpr (SHIFT_REGISTERS)
            asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");
        g8_consume<WGS, STAGES, SETS, QUANT, STAGED>(sh, ring, C, N, K, width, act, act_kind, alpha, limit, b13,
                                                     a_scales, w_scales, w_slots, gather, slot_of_row, gather_k, Q, S);
    }
}
#endif

// The entry points: `name`, launched with `threads` threads (128 per warpgroup), runs
// g8_kernel<WGS, STAGES, SETS, QUANT> (SETS sets of partial sums). Each computes C[r] = A[r] ·
// W[e]ᵀ (act_kind < 0: C [rows, N]) or its activation (C [rows, N / 2], kinds as in act_mul, f32
// bias b13 [experts, N] or null), A and W fp8 e4m3 codes: A read through a_map in boxes of the
// tile's rows by 128 codes (or, with gather_x, row r the codes of token slot_of_row[r] / gather_k
// of gather_x [·, K]), its scales a_scales [·, ceil(K / 128)] by the same row (or token); W
// [experts · N, K] through w_map in boxes of 64 rows, its scales w_scales [experts, ceil(N / 128),
// ceil(K / 128)]. An activation needs N / 2 a multiple of 64 (each half of a tile inside one scale
// block). The `_act_fp8` entry points (an activation, N / 2 a multiple of 128) write it as fp8
// codes Q [rows, N / 2] with one scale per 128 values in S [rows, N / 256] (the bf16 values' amax
// / 448) and not C; the others ignore Q and S. next_tile: as in grouped_gemm_sm90.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define G8_BODY(WGS, STAGES, SETS, QUANT, BLOCKS, DECODE)                                                  \
    g8_kernel<WGS, STAGES, SETS, QUANT, BLOCKS, DECODE>(a_map, w_map, C, counts, offsets, experts, N, K, next_tile, act_kind, \
                                        alpha, limit, b13, a_scales, w_scales, gather_x, slot_of_row, gather_k, \
                                        Q, S);
#else
#define G8_BODY(WGS, STAGES, SETS, QUANT, BLOCKS, DECODE)
#endif
#define G8_ENTRY(name, threads, WGS, STAGES, SETS, QUANT, BLOCKS, DECODE)                                  \
    extern "C" __global__ void __launch_bounds__(threads, BLOCKS)                                          \
        name(const __grid_constant__ gg_tensor_map a_map, const __grid_constant__ gg_tensor_map w_map,     \
             bf16_t* C, const int* counts, const int* offsets, int experts, int N, int K, int* next_tile,  \
             int act_kind, float alpha, float limit, const float* b13, const float* a_scales,              \
             const float* w_scales, const unsigned char* gather_x, const int* slot_of_row, int gather_k,   \
             unsigned char* Q, float* S) {                                                                 \
        G8_BODY(WGS, STAGES, SETS, QUANT, BLOCKS, DECODE)                                                  \
    }

// 128-row tiles, two consumer warpgroups, a 6-stage ring.
G8_ENTRY(grouped_gemm_fp8_sm90, 384, 2, 6, 2, false, 1, false)

// 64-row tiles, one consumer warpgroup and a 9-stage ring: for experts of few rows, whose
// tiles mostly stream weights, more of them in flight. One set of partial sums: the products
// of a few rows are short, and a second set only cost time (docs/tuning.md).
G8_ENTRY(grouped_gemm_fp8_sm90_short, 256, 1, 9, 1, false, 1, false)

// 64-row tiles, two blocks an SM over 4-stage rings.
G8_ENTRY(grouped_gemm_fp8_sm90_short_two, 256, 1, 4, 1, false, 2, false)

// The up projection with its activation quantized in the epilogue (Q, S), in 128- and 64-row
// tiles; one set of partial sums (the first sub-tile's activation takes the registers a second
// set would).
G8_ENTRY(grouped_gemm_fp8_sm90_act_fp8, 384, 2, 6, 1, true, 1, false)
G8_ENTRY(grouped_gemm_fp8_sm90_short_act_fp8, 256, 1, 9, 1, true, 1, false)

// Decode tiles: up to 16 rows of an expert by 128 weight rows, the operands swapped
// (g8_consume_decode), one consumer warpgroup and a 12-stage ring.
G8_ENTRY(grouped_gemm_fp8_sm90_decode, 256, 1, 12, 1, false, 1, true)
