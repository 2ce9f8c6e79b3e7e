// moeflow's masked grouped GEMM: the expert GEMM of the low-latency layer, where each expert's
// row count lives in device memory (so the layer can be captured in a CUDA graph) and the
// weights dominate the traffic. bf16 tensor-core MMA (m16n8k16) with f32 accumulation; weight
// and row tiles stream through shared memory with cp.async in a multi-stage pipeline (dynamic
// shared memory, at most 110592 bytes, set by the launcher). Weights are bf16 (4 stages 64
// deep, 64 token rows a pass), or fp8 e4m3 with one f32 scale per 128 × 128 block, DeepSeek-V3's
// format (4 stages 128 deep, so a stage moves as many weight bytes, 32 token rows a pass): their
// codes widen exactly to bf16 for the MMA, and each 128-deep block's partial sums are scaled
// into the accumulators. With fp8 rows too (one f32 scale per 128 values of a row, W8A8), the
// row codes widen the same way and each block's sums are scaled by the weight block's scale
// times the row group's. (Hopper runs fp8 × fp8 at tensor-core rate only through wgmma; its
// mma.sync form is emulated, slower than widening here.)
// (Compiled after common.cu and the stage files, whose helpers it uses.)

#define MG_N 128       // output columns per block (bf16: 4 warps × 32, fp8: 8 warps × 16)

__device__ __forceinline__ void mg_cp_async16(void* smem, const void* gmem, int src_bytes) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void mg_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `pending` groups of copies are in flight.
template <int pending>
__device__ __forceinline__ void mg_wait_stages() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}
__device__ __forceinline__ void mg_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

__device__ __forceinline__ void mg_mma(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two e4m3 codes (the lower byte first) as two bf16 (exact: e4m3 values are bf16 values). The
// hardware conversion needs sm_89; older GPUs (and builds with MG_SOFT_FP8, which tests this
// path on newer ones) rebuild the bits: exponent bias 7 becomes 127, the 3 mantissa bits move
// to the top of bf16's 7, subnormals (multiples of 2^-9) go through an exact float, and
// S.1111.111 is NaN.
__device__ __forceinline__ unsigned mg_e4m3_to_bf16(unsigned c) {
    const unsigned a = c & 0x7fu;
    const unsigned normal = (a << 4) + (120u << 7);
    const unsigned subnormal = __float_as_uint((float)a * 0.001953125f) >> 16;  // used when a < 8: exact
    const unsigned magnitude = a == 0x7fu ? 0x7fc0u : a < 8u ? subnormal : normal;
    return ((c & 0x80u) << 8) | magnitude;
}
__device__ __forceinline__ unsigned mg_e4m3x2_to_bf16x2(unsigned short v) {
#if __CUDA_ARCH__ >= 890 && !defined(MG_SOFT_FP8)
    unsigned h2, out;
    float lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(v));
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
#else
    return mg_e4m3_to_bf16(v & 0xffu) | (mg_e4m3_to_bf16(v >> 8) << 16);
#endif
}

// The body of the kernels below; FP8 selects e4m3 weights with block scales `S`, A8 (with FP8)
// e4m3 rows with scales `SA` [rows, ceil(K / 128)].
template <bool FP8, bool A8>
__device__ __forceinline__ void masked_gemm_body(const void* W, const float* S, const void* A, const float* SA,
                                                 bf16_t* C, const int* counts, const int* offsets, int cap, int N,
                                                 int K) {
    // Depth per stage, stages, and shared-memory pitches (8 bf16 / 16 bytes past the data
    // keep the fragment loads free of bank conflicts).
    // fp8 takes 32 token rows per pass, so 4 stages of 128-deep fp8 tiles fit twice per SM.
    constexpr int MG_M = FP8 ? 32 : 64;
    constexpr int MT = MG_M / 16;  // 16-row MMA tiles per pass
    constexpr int KD = FP8 ? 128 : 64;
    constexpr int STAGES = 4;
    // fp8 runs 8 warps of 16 columns (its code widening needs more warps to hide latency);
    // bf16 4 warps of 32 columns.
    constexpr int THREADS = FP8 ? 256 : 128;
    constexpr int NT = MG_N / (THREADS / 32) / 8;  // 8-column MMA tiles per warp
    constexpr int wbytes = FP8 ? 1 : 2, abytes = A8 ? 1 : 2;
    constexpr int wpitch = KD * wbytes + 16;  // bytes per weight row
    constexpr int apitch = KD * abytes + 16;  // bytes per token row
    extern __shared__ __align__(16) unsigned char mg_smem[];
    unsigned char* wsm = mg_smem;
    unsigned char* asm_ = mg_smem + STAGES * MG_N * wpitch;
    int e = blockIdx.y, n0 = blockIdx.x * MG_N;
    long base = offsets ? (long)offsets[e] : (long)e * cap;
    int count = offsets ? counts[e] : min(counts[e], cap);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const unsigned char* w = (const unsigned char*)W + (long)e * N * K * wbytes;
    int kblocks = (K + 127) / 128;
    const float* scale = FP8 ? S + ((long)e * ((N + 127) / 128) + blockIdx.x) * kblocks : nullptr;
    int ksteps = (K + KD - 1) / KD;
    for (int m0 = 0; m0 < count; m0 += MG_M) {
        int rows = min(MG_M, count - m0);
        int mtiles = (rows + 15) / 16;
        const unsigned char* a = (const unsigned char*)A + (base + m0) * K * abytes;
        float acc[MT][NT][4], part[MT][NT][4];
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[i][j][q] = part[i][j][q] = 0.0f;
        // Stage s gets depth step kk: 128 weight rows and 64 token rows of KD values, 16 bytes
        // a copy; past K, N or the rows, zeros.
        auto load = [&](int s, int kk) {
            constexpr int wchunks = KD * wbytes / 16, achunks = KD * abytes / 16;  // copies per row
#pragma unroll
            for (int i = 0; i < MG_N * wchunks / THREADS; i++) {
                int c = threadIdx.x + i * THREADS, row = c / wchunks, col = (c % wchunks) * 16;  // bytes
                int k = kk * KD + col / wbytes;
                bool ok = n0 + row < N && k < K;
                mg_cp_async16(wsm + ((long)s * MG_N + row) * wpitch + col,
                              ok ? w + ((long)(n0 + row) * K + k) * wbytes : w, ok ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < MG_M * achunks / THREADS; i++) {
                int c = threadIdx.x + i * THREADS, row = c / achunks, col = (c % achunks) * 16;  // bytes
                int k = kk * KD + col / abytes;
                bool ok = row < rows && k < K;
                mg_cp_async16(asm_ + ((long)s * MG_M + row) * apitch + col,
                              ok ? a + ((long)row * K + k) * abytes : a, ok ? 16 : 0);
            }
        };
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < ksteps) load(s, s);
            mg_commit();
        }
        for (int kk = 0; kk < ksteps; kk++) {
            mg_wait_stages<STAGES - 2>();
            __syncthreads();
            int next = kk + STAGES - 1;
            if (next < ksteps) load(next % STAGES, next);
            mg_commit();
            int st = kk % STAGES;
            const unsigned char* wst = wsm + (long)st * MG_N * wpitch;
            const unsigned char* ast = asm_ + (long)st * MG_M * apitch;
#pragma unroll
            for (int k16 = 0; k16 < KD; k16 += 16) {
                unsigned bf[NT][2];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const unsigned char* wr = wst + (warp * NT * 8 + nt * 8 + g) * wpitch;
                    int k0 = k16 + 2 * tq;
                    if (FP8) {
                        bf[nt][0] = mg_e4m3x2_to_bf16x2(*(const unsigned short*)(wr + k0));
                        bf[nt][1] = mg_e4m3x2_to_bf16x2(*(const unsigned short*)(wr + k0 + 8));
                    } else {
                        bf[nt][0] = *(const unsigned*)(wr + 2 * k0);
                        bf[nt][1] = *(const unsigned*)(wr + 2 * (k0 + 8));
                    }
                }
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if (mt < mtiles) {
                        const unsigned char* ar = ast + (mt * 16 + g) * apitch + abytes * (k16 + 2 * tq);
                        unsigned af[4];
                        if (A8) {
                            // fp8 rows: codes widened exactly, as the weights' are.
                            af[0] = mg_e4m3x2_to_bf16x2(*(const unsigned short*)ar);
                            af[1] = mg_e4m3x2_to_bf16x2(*(const unsigned short*)(ar + 8 * apitch));
                            af[2] = mg_e4m3x2_to_bf16x2(*(const unsigned short*)(ar + 8));
                            af[3] = mg_e4m3x2_to_bf16x2(*(const unsigned short*)(ar + 8 * apitch + 8));
                        } else {
                            af[0] = *(const unsigned*)ar;
                            af[1] = *(const unsigned*)(ar + 8 * apitch);
                            af[2] = *(const unsigned*)(ar + 16);
                            af[3] = *(const unsigned*)(ar + 8 * apitch + 16);
                        }
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) mg_mma(FP8 ? part[mt][nt] : acc[mt][nt], af, bf[nt]);
                    }
                }
            }
            // fp8: every step is one 128-deep scale block; scale its sums in.
            if (FP8) {
                float sc = scale[kk];
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    // W8A8: times the scale of each row's group (rows past the count have none).
                    float s0 = sc, s1 = sc;
                    if (A8) {
                        int r0 = i * 16 + g, r1 = r0 + 8;
                        s0 = r0 < rows ? sc * SA[(base + m0 + r0) * kblocks + kk] : 0.0f;
                        s1 = r1 < rows ? sc * SA[(base + m0 + r1) * kblocks + kk] : 0.0f;
                    }
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int q = 0; q < 4; q++) {
                            acc[i][j][q] += (q < 2 ? s0 : s1) * part[i][j][q];
                            part[i][j][q] = 0.0f;
                        }
                }
            }
        }
        mg_wait_all();
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            if (mt >= mtiles) continue;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                int col = n0 + warp * NT * 8 + nt * 8 + 2 * tq;
                if (col >= N) continue;
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    int r = mt * 16 + g + 8 * half;
                    if (r >= rows) continue;
                    unsigned lo = f32_to_bf16(acc[mt][nt][2 * half]), hi = f32_to_bf16(acc[mt][nt][2 * half + 1]);
                    *(unsigned*)&C[(base + m0 + r) * N + col] = lo | (hi << 16);
                }
            }
        }
    }
}

extern "C" {

// C[b_e + r, :] = A[b_e + r, :] · W[e]ᵀ for every expert e and r < counts[e], where expert e's
// rows start at b_e = offsets[e] (grouped layout), or at e · cap with counts clamped to cap
// (padded layout, offsets null): W is [experts, N, K] row-major bf16, A and C hold rows of K and
// N bf16. Rows past an expert's count are neither read nor written; an expert without rows
// costs nothing. Grid (ceil(N / 128), experts), 128 threads, 110592 bytes of dynamic shared
// memory. Needs K % 8 == 0 and N % 2 == 0.
__global__ void __launch_bounds__(128) masked_gemm(const bf16_t* W, const bf16_t* A, bf16_t* C, const int* counts,
                                                   const int* offsets, int cap, int N, int K) {
    masked_gemm_body<false, false>(W, nullptr, A, nullptr, C, counts, offsets, cap, N, K);
}

// masked_gemm with fp8 e4m3 weights W [experts, N, K] and their scales S [experts,
// ceil(N / 128), ceil(K / 128)] (weight = code · scale of its 128 × 128 block), 256 threads.
// Needs K % 16 == 0 and N % 2 == 0.
__global__ void __launch_bounds__(256) masked_gemm_fp8(const unsigned char* W, const float* S, const bf16_t* A,
                                                       bf16_t* C, const int* counts, const int* offsets, int cap,
                                                       int N, int K) {
    masked_gemm_body<true, false>(W, S, A, nullptr, C, counts, offsets, cap, N, K);
}

// masked_gemm_fp8 with e4m3 rows A too, and their scales SA [rows, ceil(K / 128)] (row value
// = code · scale of its group of 128), as QuantConfig::Fp8Block quantizes them. Needs K % 16 == 0.
__global__ void __launch_bounds__(256) masked_gemm_w8a8(const unsigned char* W, const float* S,
                                                        const unsigned char* A, const float* SA, bf16_t* C,
                                                        const int* counts, const int* offsets, int cap, int N,
                                                        int K) {
    masked_gemm_body<true, true>(W, S, A, SA, C, counts, offsets, cap, N, K);
}

}  // extern "C"
