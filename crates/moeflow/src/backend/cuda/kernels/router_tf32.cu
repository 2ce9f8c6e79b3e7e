// moeflow's router GEMM on the tensor cores at f32 accuracy ("3xTF32"): each f32 operand is split
// into a TF32 head and a TF32 tail (rt_split), and a product is the sum of three TF32 products,
// head·tail + tail·head + head·head; the tail·tail term is below f32's rounding. The tensor
// cores add the products of one 8-deep step, and the accumulators of chained steps, with
// truncation, so their accumulators are chained over RT_BK columns only and then added into f32
// registers with rounding: the logits land as close to the exact sums as a plain f32 GEMM's.
// A gate whose values are TF32 values (bf16 ones are) has zero tails: its `_tf32_gate` kernels
// skip head·tail, which only added zeros. (Compiled after masked_gemm.cu, whose cp.async
// helpers it uses.)

#define RT_BM 128     // tokens a block
#define RT_BN 128     // experts a block
#define RT_BK 32      // columns a stage (and a chain of tensor-core accumulation)
#define RT_LD 36      // floats between rows in shared memory: the fragments' loads miss no bank
#define RT_STAGES 3
#define RT_THREADS 256

// v = head + tail, each a TF32 value in a register: the head is v with its mantissa cut to TF32's
// 10 bits (exact), the tail the rest (exact in f32), which the tensor cores read cut to TF32
// too: head + tail is then within 2^-20 |v| of v, and the products' errors have random signs.
__device__ __forceinline__ void rt_split(float v, unsigned& head, unsigned& tail) {
    head = __float_as_uint(v) & 0xffffe000u;
    tail = __float_as_uint(v - __uint_as_float(head));
}

// c += a · b for one 16 × 8 × 8 TF32 tile (f32 accumulators). Not volatile: the compiler may
// interleave independent products.
__device__ __forceinline__ void rt_mma(float* c, const unsigned* a, const unsigned* b) {
    asm(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// This lane's TF32 fragment of a 16 × 8 token tile whose lane-own value sits at p (row lane / 4,
// column lane % 4, RT_LD floats a row): the values at rows +0 / +8 and columns +0 / +4, the
// order mma.sync's and wgmma's register operand takes, each split into its head and tail.
__device__ __forceinline__ void rt_split_fragment(const float* p, unsigned* head, unsigned* tail) {
    rt_split(p[0], head[0], tail[0]);
    rt_split(p[8 * RT_LD], head[1], tail[1]);
    rt_split(p[4], head[2], tail[2]);
    rt_split(p[8 * RT_LD + 4], head[3], tail[3]);
}

// Stores the sums s0 and s1 of token t and experts e and e + 1 into out [T, E], those within
// the batch and the experts only, each plus bias[e] when `bias` is not null.
__device__ __forceinline__ void rt_store_pair(float* out, int T, int E, int t, int e, float s0, float s1,
                                              const float* bias) {
    if (t >= T) return;
    if (e < E) out[(long)t * E + e] = bias ? s0 + bias[e] : s0;
    if (e + 1 < E) out[(long)t * E + e + 1] = bias ? s1 + bias[e + 1] : s1;
}

// Two f32 rounded to the nearest bf16, ties to even, `lo` in the low half, in one instruction:
// f32_to_bf16's bits but for NaN payloads (NaN stays NaN either way).
__device__ __forceinline__ unsigned rt_pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The bf16 copy of the tokens' values this thread copied into the stage at `xs` (chunk columns
// from k0, as the kernels' loads deal them): into x_bf [T, H] (rt_pack_bf16), the values of the
// batch's tokens and of the split's columns only, by the router that reads them anyway. Row r
// of a token tile is written by the block of expert tile (r / 4 + r / 32) mod the tiles
// (blockIdx.x), so each value is written once and the blocks share the stores: bit u of `mine`
// (rt_copy_rows) says whether this thread's piece u lies in such a row. A warp's pieces u lie
// in four rows r / 4 alike, so a warp copies a piece or skips it whole, and over the pieces
// the warps share the copies evenly (r / 32 is the piece).
#define RT_PIECES ((RT_BM * RT_BK / 4) / RT_THREADS)  // 16-byte pieces of a stage a thread copies
__device__ __forceinline__ unsigned rt_copy_rows() {
    unsigned mine = 0;
#pragma unroll
    for (int u = 0; u < RT_PIECES; u++) {
        const int r = (threadIdx.x + u * RT_THREADS) / (RT_BK / 4);
        if ((r / 4 + r / 32) % gridDim.x == blockIdx.x) mine |= 1u << u;
    }
    return mine;
}
__device__ __forceinline__ void rt_copy_bf16(const float* xs, bf16_t* x_bf, unsigned mine, int t0, int T, int H,
                                             int k0, int k_hi) {
#pragma unroll
    for (int u = 0; u < RT_PIECES; u++) {
        int i = threadIdx.x + u * RT_THREADS, r = i / (RT_BK / 4), c4 = (i % (RT_BK / 4)) * 4;
        int t = t0 + r, k = k0 + c4;
        if (((mine >> u) & 1u) && t < T && k < k_hi) {
            float4 v = *(const float4*)(xs + r * RT_LD + c4);
            *(uint2*)(x_bf + (long)t * H + k) = make_uint2(rt_pack_bf16(v.x, v.y), rt_pack_bf16(v.z, v.w));
        }
    }
}

// partial[z, t, e] = the sum over the columns of split z (`cols` columns each, the last one
// to H) of x[t, k] · gate[e, k], for x [T, H] and gate [E, H] in f32, H a multiple of 4; plus
// bias[e] when `bias` is not null (a caller with one split adds the bias here); and, when
// `x_bf` is not null, x's bf16 copy into it (rt_copy_bf16). A block of 256 threads takes 128
// tokens (blockIdx.y) by 128 experts (blockIdx.x, so the blocks that read the same tokens run
// together) of one split (blockIdx.z); its 8 warps take 64 × 32 outputs each. The tiles
// stream through RT_STAGES stages of shared memory with cp.async. GATE_TAILS false for a gate
// of TF32 values: the products with its zero tails are dropped, which added exact zeros.
template <bool GATE_TAILS>
__device__ __forceinline__ void rt_partials(const float* x, const float* gate, int T, int E, int H, int cols,
                                            const float* bias, float* partial, bf16_t* x_bf) {
    extern __shared__ __align__(16) float rt_smem[];
    int e0 = blockIdx.x * RT_BN, t0 = blockIdx.y * RT_BM;
    int k_lo = blockIdx.z * cols, k_hi = min(H, k_lo + cols);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int wm = warp / 4, wn = warp % 4;
    float* xs = rt_smem;                          // [stage][RT_BM][RT_LD]
    float* gs = rt_smem + RT_STAGES * RT_BM * RT_LD;  // [stage][RT_BN][RT_LD]
    int chunks = k_hi > k_lo ? (k_hi - k_lo + RT_BK - 1) / RT_BK : 0;
    // This warp's 16-row tiles that hold tokens (a small batch leaves the others zero).
    int live = min(4, max(0, (T - t0 - wm * 64 + 15) / 16));

    // Stage s gets chunk c: 128 rows × 32 columns of each operand, 16 bytes a copy, zeros past
    // T, E and the split's last column.
    auto load = [&](int c, int s) {
        int k0 = k_lo + c * RT_BK;
#pragma unroll
        for (int u = 0; u < (RT_BM * RT_BK / 4) / RT_THREADS; u++) {
            int i = threadIdx.x + u * RT_THREADS, r = i / (RT_BK / 4), c4 = (i % (RT_BK / 4)) * 4, k = k0 + c4;
            int t = t0 + r, e = e0 + r;
            bool kin = k < k_hi;
            mg_cp_async16(xs + ((long)s * RT_BM + r) * RT_LD + c4, kin && t < T ? x + (long)t * H + k : x,
                          kin && t < T ? 16 : 0);
            mg_cp_async16(gs + ((long)s * RT_BN + r) * RT_LD + c4, kin && e < E ? gate + (long)e * H + k : gate,
                          kin && e < E ? 16 : 0);
        }
    };

    float sum[4][4][4], acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) sum[i][j][v] = 0.0f;

    for (int c = 0; c < RT_STAGES - 1; c++) {
        if (c < chunks) load(c, c);
        mg_commit();
    }
    const unsigned mine = x_bf ? rt_copy_rows() : 0u;
    for (int c = 0; c < chunks; c++) {
        mg_wait_stages<RT_STAGES - 2>();
        if (mine)
            rt_copy_bf16(xs + (long)(c % RT_STAGES) * RT_BM * RT_LD, x_bf, mine, t0, T, H, k_lo + c * RT_BK, k_hi);
        __syncthreads();
        // The stage read RT_STAGES - 1 chunks ago is free again (every warp passed the barrier).
        if (c + RT_STAGES - 1 < chunks) load(c + RT_STAGES - 1, (c + RT_STAGES - 1) % RT_STAGES);
        mg_commit();
        const float* xa = xs + (long)(c % RT_STAGES) * RT_BM * RT_LD + (wm * 64 + g) * RT_LD + q;
        const float* gb = gs + (long)(c % RT_STAGES) * RT_BN * RT_LD + (wn * 32 + g) * RT_LD + q;
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int v = 0; v < 4; v++) acc[i][j][v] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < RT_BK; kk += 8) {
            unsigned ah[4][4], at[4][4], bh[4][2], bt[4][2];
#pragma unroll
            for (int i = 0; i < 4; i++) rt_split_fragment(xa + i * 16 * RT_LD + kk, ah[i], at[i]);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float* p = gb + j * 8 * RT_LD + kk;
                rt_split(p[0], bh[j][0], bt[j][0]);
                rt_split(p[4], bh[j][1], bt[j][1]);
            }
            // Each product over every tile before the next, so 16 independent products lie
            // between two into the same accumulator.
#pragma unroll
            for (int p = GATE_TAILS ? 0 : 1; p < 3; p++)
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        if (i >= live) continue;
                        rt_mma(acc[i][j], p == 1 ? at[i] : ah[i], p == 0 ? bt[j] : bh[j]);
                    }
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int v = 0; v < 4; v++) sum[i][j][v] += acc[i][j][v];
    }

    float* out = partial + (long)blockIdx.z * T * E;
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int e = e0 + wn * 32 + j * 8 + 2 * q;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                int t = t0 + wm * 64 + i * 16 + g + 8 * half;
                rt_store_pair(out, T, E, t, e, sum[i][j][2 * half], sum[i][j][2 * half + 1], bias);
            }
        }
    }
}

// rt_partials for any f32 gate, and for a gate of TF32 values (two products a product, the
// same bits).
extern "C" __global__ void __launch_bounds__(RT_THREADS)
    router_partials_tf32(const float* x, const float* gate, int T, int E, int H, int cols, const float* bias,
                         float* partial, bf16_t* x_bf) {
    rt_partials<true>(x, gate, T, E, H, cols, bias, partial, x_bf);
}
extern "C" __global__ void __launch_bounds__(RT_THREADS)
    router_partials_tf32_tf32_gate(const float* x, const float* gate, int T, int E, int H, int cols,
                                   const float* bias, float* partial, bf16_t* x_bf) {
    rt_partials<false>(x, gate, T, E, H, cols, bias, partial, x_bf);
}

// The same partial sums on Hopper's wgmma (router_partials_tf32_sm90): a block's two warpgroups
// take 64 tokens each by the tile's 128 experts, each 8-deep step three wgmma.m64n128k8 (the
// token heads and tails from registers, the gate's from shared memory, where each thread splits
// the 16-byte pieces it copied into a head tile and a tail tile in the 128-byte swizzled layout
// wgmma reads). The accumulators are chained over RT_BK columns, then added into f32
// registers, and x's bf16 copy is written, as above. The chunks flow through RT_SM90_STAGES
// stages: while chunk c - 1 multiplies, chunks c + 1 and c + 2 load and chunk c is split, so
// the tensor cores wait only while the sums are added and the next chunk's token fragments
// split. A gate of TF32 values (bf16 ones, as checkpoints store their routers, among them;
// router_partials_tf32_sm90_tf32_gate) has zero tails: it is multiplied as copied, and each
// step drops the product with its tails, which adds exact zeros, so the logits keep their
// bits. Needs sm_90a; the host launches it only there.
#define RT_GATE_TILE (RT_BN * RT_BK * 4)  // bytes of a stage's gate heads (or tails)
#define RT_SM90_STAGES 4                  // chunks c - 1 (multiplying), c (splitting), c + 1, c + 2
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d[64 × 128 fragment] (+)= a[64 × 8, registers] · B[128 × 8]ᵀ (descriptor b); `accumulate` 0
// overwrites d.
__device__ __forceinline__ void rt_wgmma(float* d, const unsigned* a, u64 b, int accumulate) {
    asm volatile(
        "{\n .reg .pred acc;\n setp.ne.b32 acc, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, acc, 1, 1;\n}\n"
        : GG_D8(0), GG_D8(8), GG_D8(16), GG_D8(24), GG_D8(32), GG_D8(40), GG_D8(48), GG_D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// bf16 tokens in a stage: rows of RT_BK values, RT_LD_BF16 apart (80 bytes, so that a warp's
// fragment loads miss no bank), in the room of the f32 tokens' stage.
#define RT_LD_BF16 40

// The fragment of rt_split_fragment from bf16 tokens: their values are TF32 values (bf16 has
// fewer mantissa bits), so each is its own head, exact, and has no tail.
__device__ __forceinline__ void rt_bf16_fragment(const bf16_t* p, unsigned* head) {
    head[0] = (unsigned)p[0] << 16;
    head[1] = (unsigned)p[8 * RT_LD_BF16] << 16;
    head[2] = (unsigned)p[4] << 16;
    head[3] = (unsigned)p[8 * RT_LD_BF16 + 4] << 16;
}

// The kernels' body: GATE_TAILS false for a gate of TF32 values; X_BF16 for bf16 tokens (`xv`
// then holds bf16 values and the gate must hold TF32 values): each step is then the one
// product of the heads, the products with the tokens' tails having been exact zeros.
template <bool GATE_TAILS, bool X_BF16>
__device__ __forceinline__ void rt_partials_sm90(const void* xv, const float* gate, int T, int E, int H, int cols,
                                                 const float* bias, float* partial, bf16_t* x_bf) {
    const float* x = (const float*)xv;
    const bf16_t* xb = (const bf16_t*)xv;
    constexpr int STAGES = RT_SM90_STAGES, AHEAD = STAGES - 2;  // chunks loading while one is split
    extern __shared__ __align__(16) unsigned char rt_raw[];
    // The gate tiles start 1024-aligned (the swizzle pattern repeats every 1024 bytes).
    unsigned char* heads = rt_raw + ((1024 - (gg_smem(rt_raw) & 1023)) & 1023);
    unsigned char* tails = heads + STAGES * RT_GATE_TILE;
    float* xs = (float*)(tails + STAGES * RT_GATE_TILE);  // [stage][RT_BM][RT_LD]
    int e0 = blockIdx.x * RT_BN, t0 = blockIdx.y * RT_BM;
    int k_lo = blockIdx.z * cols, k_hi = min(H, k_lo + cols);
    int wg = threadIdx.x / 128, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int wq = (threadIdx.x % 128) / 32;
    int chunks = k_hi > k_lo ? (k_hi - k_lo + RT_BK - 1) / RT_BK : 0;
    // A warpgroup whose 64 tokens all lie past the batch only takes part in the loads.
    bool busy = t0 + wg * 64 < T;
    constexpr int PIECES = (RT_BN * RT_BK / 4) / RT_THREADS;  // 16-byte gate pieces a thread copies

    // This thread's 16-byte pieces of a stage: piece p of rows r0 + 32 u (u < PIECES) of both
    // operands, one p for all (the rows' r % 8 alike too), so their places are found once:
    // where their columns start in x and the gate (at the split's first column), which of the
    // rows lie within T and E, and their offsets in a stage.
    const int p = threadIdx.x % (RT_BK / 4), r0 = threadIdx.x / (RT_BK / 4);
    const float* x_at = x + (long)(t0 + r0) * H + k_lo + 4 * p;
    const bf16_t* xb_at = xb + (long)(t0 + r0) * H + k_lo + 8 * (p % 4);
    const float* gate_at = gate + (long)(e0 + r0) * H + k_lo + 4 * p;
    unsigned x_rows = 0, gate_rows = 0;
#pragma unroll
    for (int u = 0; u < PIECES; u++) {
        if (t0 + r0 + 32 * u < T) x_rows |= 1u << u;
        if (e0 + r0 + 32 * u < E) gate_rows |= 1u << u;
    }
    const int x_off = r0 * RT_LD + 4 * p, gate_off = r0 * 128 + ((p ^ (r0 & 7)) << 4);
    const int xb_off = r0 * RT_LD_BF16 + 8 * (p % 4);

    // Stage s gets chunk c: the tokens' 128 × 32 values padded as above, and the gate's 128
    // rows of 32 values (128 bytes), piece p of row r at p ^ (r % 8); zeros past T, E and the
    // split's last column.
    auto load = [&](int c, int s) {
        const bool kin = k_lo + c * RT_BK + 4 * p < k_hi;
#pragma unroll
        for (int u = 0; u < PIECES; u++) {
            const bool xin = kin && (x_rows >> u & 1u), gin = kin && (gate_rows >> u & 1u);
            if constexpr (!X_BF16)
                mg_cp_async16(xs + s * RT_BM * RT_LD + x_off + 32 * u * RT_LD,
                              xin ? x_at + (long)u * 32 * H + c * RT_BK : x, xin ? 16 : 0);
            mg_cp_async16(heads + s * RT_GATE_TILE + gate_off + 32 * u * 128,
                          gin ? gate_at + (long)u * 32 * H + c * RT_BK : gate, gin ? 16 : 0);
        }
        if constexpr (X_BF16) {
            // A row's RT_BK bf16 values are four 16-byte pieces, copied by the threads of p < 4.
            const bool bin = p < 4 && k_lo + c * RT_BK + 8 * p < k_hi;
#pragma unroll
            for (int u = 0; u < PIECES; u++) {
                const bool in = bin && (x_rows >> u & 1u);
                if (p < 4)
                    mg_cp_async16((bf16_t*)(xs + s * RT_BM * RT_LD) + xb_off + 32 * u * RT_LD_BF16,
                                  in ? xb_at + (long)u * 32 * H + c * RT_BK : xb, in ? 16 : 0);
            }
        }
    };

    // acc holds the products of the chunk in flight (zeros before the first): every pass waits
    // for them and adds them in, so no wait sits on a branch (ptxas would serialize the
    // wgmmas, its warning C7518).
    float sum[64], acc[64];
#pragma unroll
    for (int j = 0; j < 64; j++) sum[j] = acc[j] = 0.0f;

    for (int c = 0; c < AHEAD; c++) {
        if (c < chunks) load(c, c);
        mg_commit();
    }
    const unsigned mine = x_bf ? rt_copy_rows() : 0u;
    // Brings chunk c into stage c % STAGES, split (and its tokens' bf16 copy written), and
    // starts loading chunk c + AHEAD.
    auto take = [&](int c) {
        int s = c % STAGES;
        mg_wait_stages<AHEAD - 1>();
        if (mine) rt_copy_bf16(xs + (long)s * RT_BM * RT_LD, x_bf, mine, t0, T, H, k_lo + c * RT_BK, k_hi);
        // This thread's gate pieces of the chunk have landed: each becomes its head, in place,
        // and its tail, at the same place of the tail tile.
#pragma unroll
        for (int u = 0; u < (GATE_TAILS ? PIECES : 0); u++) {
            const int at = s * RT_GATE_TILE + gate_off + 32 * u * 128;
            float4 v = *(float4*)(heads + at);
            unsigned hx, tx, hy, ty, hz, tz, hw, tw;
            rt_split(v.x, hx, tx);
            rt_split(v.y, hy, ty);
            rt_split(v.z, hz, tz);
            rt_split(v.w, hw, tw);
            *(uint4*)(heads + at) = make_uint4(hx, hy, hz, hw);
            *(uint4*)(tails + at) = make_uint4(tx, ty, tz, tw);
        }
        // Copied (and split) through the generic proxy, read by wgmma through the async one.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        // The stage chunk c + AHEAD loads into held chunk c - 2, whose products every
        // warpgroup waited for before it issued chunk c - 1's (and then passed the barrier).
        if (c + AHEAD < chunks) load(c + AHEAD, (c + AHEAD) % STAGES);
        mg_commit();
    };
    if (!busy) {
        for (int c = 0; c < chunks; c++) take(c);
        return;
    }
    for (int c = 0; c < chunks; c++) {
        take(c);
        // Chunk c - 1's products, added in once done. Only then are chunk c's token fragments
        // written: wgmma reads its register operands asynchronously too.
        gg_wait<0>();
        gg_pin<64>(acc);
#pragma unroll
        for (int j = 0; j < 64; j++) sum[j] += acc[j];
        int s = c % STAGES;
        const float* xa = xs + (long)s * RT_BM * RT_LD + (wg * 64 + wq * 16 + g) * RT_LD + q;
        unsigned ah[4][4], at[4][4];
        if constexpr (X_BF16) {
            const bf16_t* xb_row =
                (const bf16_t*)(xs + (long)s * RT_BM * RT_LD) + (wg * 64 + wq * 16 + g) * RT_LD_BF16 + q;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) rt_bf16_fragment(xb_row + kk * 8, ah[kk]);
        } else {
#pragma unroll
            for (int kk = 0; kk < 4; kk++) rt_split_fragment(xa + kk * 8, ah[kk], at[kk]);
        }
        u64 dh = gg_desc(heads + s * RT_GATE_TILE), dt = gg_desc(tails + s * RT_GATE_TILE);
        gg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            if constexpr (GATE_TAILS) rt_wgmma(acc, ah[kk], dt + 2 * kk, kk > 0);
            if constexpr (!X_BF16) rt_wgmma(acc, at[kk], dh + 2 * kk, GATE_TAILS || kk > 0);
            rt_wgmma(acc, ah[kk], dh + 2 * kk, !X_BF16 || kk > 0);
        }
        gg_commit();
    }
    gg_wait<0>();
    gg_pin<64>(acc);
#pragma unroll
    for (int j = 0; j < 64; j++) sum[j] += acc[j];

    // d[4j + {0,1}]: token 16·warp + lane/4 of the warpgroup's 64, experts 8j + 2·(lane%4) +
    // {0,1}; d[4j + {2,3}] the token 8 below.
    float* out = partial + (long)blockIdx.z * T * E;
#pragma unroll
    for (int j = 0; j < 16; j++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int t = t0 + wg * 64 + wq * 16 + g + 8 * half;
            rt_store_pair(out, T, E, t, e0 + 8 * j + 2 * q, sum[4 * j + 2 * half], sum[4 * j + 2 * half + 1], bias);
        }
    }
}
#define RT_SM90_BODY(GATE_TAILS) rt_partials_sm90<GATE_TAILS, false>(x, gate, T, E, H, cols, bias, partial, x_bf);
#else
#define RT_SM90_BODY(GATE_TAILS)
#endif

// The same for bf16 tokens x [T, H] (H a multiple of 8) and a gate of TF32 values: one product
// a step, and the logits' bits those of the forms below on the same values as f32; no bf16
// copy (x_bf is ignored: the tokens are one).
extern "C" __global__ void __launch_bounds__(RT_THREADS, 1)
    router_partials_tf32_sm90_bf16_tokens(const bf16_t* x, const float* gate, int T, int E, int H, int cols,
                                          const float* bias, float* partial, bf16_t* x_bf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    rt_partials_sm90<false, true>(x, gate, T, E, H, cols, bias, partial, nullptr);
#endif
}

// partial and x_bf as router_partials_tf32's, any f32 gate.
extern "C" __global__ void __launch_bounds__(RT_THREADS, 1)
    router_partials_tf32_sm90(const float* x, const float* gate, int T, int E, int H, int cols, const float* bias,
                              float* partial, bf16_t* x_bf) {
    RT_SM90_BODY(true)
}

// The same for a gate whose every value is a TF32 value (its low 13 mantissa bits zero): the
// same bits, two products a step.
extern "C" __global__ void __launch_bounds__(RT_THREADS, 1)
    router_partials_tf32_sm90_tf32_gate(const float* x, const float* gate, int T, int E, int H, int cols,
                                        const float* bias, float* partial, bf16_t* x_bf) {
    RT_SM90_BODY(false)
}
