// moeflow's masked grouped GEMM: the expert GEMM of the low-latency layer, where each expert's
// row count lives in device memory (so the layer can be captured in a CUDA graph) and the
// weights dominate the traffic. bf16 tensor-core MMA (m16n8k16) with f32 accumulation; weight
// and row tiles stream through shared memory with cp.async in a 4-stage pipeline (dynamic
// shared memory: MG_STAGES · (MG_N + MG_M) · MG_LD · 2 = 110592 bytes, set by the launcher).
// (Compiled after moe.cu, whose helpers it uses.)

#define MG_M 64        // rows per pass
#define MG_N 128       // output columns per block (4 warps × 32)
#define MG_K 64        // depth per pipeline stage
#define MG_LD 72       // shared-memory row pitch in bf16 (64 + 8 breaks bank conflicts)
#define MG_STAGES 4

__device__ __forceinline__ void mg_cp_async16(void* smem, const void* gmem, int src_bytes) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void mg_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void mg_wait_stages() { asm volatile("cp.async.wait_group 2;\n" ::); }
__device__ __forceinline__ void mg_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

__device__ __forceinline__ void mg_mma(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

extern "C" {

// C[e cap + r, :] = A[e cap + r, :] · W[e]ᵀ for every expert e and r < counts[e] (clamped to
// cap): W is [experts, N, K] row-major bf16, A and C are [experts · cap, K] and [experts · cap,
// N] bf16. Rows past an expert's count are neither read nor written; an expert without rows
// costs nothing. Grid (ceil(N / 128), experts), 128 threads, 110592 bytes of dynamic shared
// memory. Needs K % 8 == 0 and N % 2 == 0.
__global__ void __launch_bounds__(128) masked_gemm(const bf16_t* W, const bf16_t* A, bf16_t* C, const int* counts,
                                                   int cap, int N, int K) {
    extern __shared__ __align__(16) unsigned char mg_smem[];
    bf16_t(*ws)[MG_N][MG_LD] = (bf16_t(*)[MG_N][MG_LD])mg_smem;
    bf16_t(*as)[MG_M][MG_LD] = (bf16_t(*)[MG_M][MG_LD])(mg_smem + MG_STAGES * MG_N * MG_LD * 2);
    int e = blockIdx.y, n0 = blockIdx.x * MG_N;
    int count = min(counts[e], cap);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const bf16_t* w = W + ((long)e * N) * K;
    int ksteps = (K + MG_K - 1) / MG_K;
    for (int m0 = 0; m0 < count; m0 += MG_M) {
        int rows = min(MG_M, count - m0);
        int mtiles = (rows + 15) / 16;
        const bf16_t* a = A + ((long)e * cap + m0) * K;
        float acc[4][4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;
        // Stage s gets depth step kk: 128 weight rows and 64 token rows of 64 values, 16 bytes
        // a copy; past K, N or the rows, zeros.
        auto load = [&](int s, int kk) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int c = threadIdx.x + i * 128, row = c >> 3, col = (c & 7) * 8, k = kk * MG_K + col;
                bool ok = n0 + row < N && k < K;
                mg_cp_async16(&ws[s][row][col], ok ? w + (long)(n0 + row) * K + k : w, ok ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int c = threadIdx.x + i * 128, row = c >> 3, col = (c & 7) * 8, k = kk * MG_K + col;
                bool ok = row < rows && k < K;
                mg_cp_async16(&as[s][row][col], ok ? a + (long)row * K + k : a, ok ? 16 : 0);
            }
        };
#pragma unroll
        for (int s = 0; s < MG_STAGES - 1; s++) {
            if (s < ksteps) load(s, s);
            mg_commit();
        }
        for (int kk = 0; kk < ksteps; kk++) {
            mg_wait_stages();
            __syncthreads();
            int next = kk + MG_STAGES - 1;
            if (next < ksteps) load(next % MG_STAGES, next);
            mg_commit();
            int st = kk % MG_STAGES;
#pragma unroll
            for (int k16 = 0; k16 < MG_K; k16 += 16) {
                unsigned bf[4][2];
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    int n = warp * 32 + nt * 8 + g;
                    bf[nt][0] = *(const unsigned*)&ws[st][n][k16 + 2 * tq];
                    bf[nt][1] = *(const unsigned*)&ws[st][n][k16 + 2 * tq + 8];
                }
#pragma unroll
                for (int mt = 0; mt < 4; mt++) {
                    if (mt < mtiles) {
                        int r = mt * 16 + g;
                        unsigned af[4];
                        af[0] = *(const unsigned*)&as[st][r][k16 + 2 * tq];
                        af[1] = *(const unsigned*)&as[st][r + 8][k16 + 2 * tq];
                        af[2] = *(const unsigned*)&as[st][r][k16 + 2 * tq + 8];
                        af[3] = *(const unsigned*)&as[st][r + 8][k16 + 2 * tq + 8];
#pragma unroll
                        for (int nt = 0; nt < 4; nt++) mg_mma(acc[mt][nt], af, bf[nt]);
                    }
                }
            }
        }
        mg_wait_all();
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < 4; mt++) {
            if (mt >= mtiles) continue;
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                int col = n0 + warp * 32 + nt * 8 + 2 * tq;
                if (col >= N) continue;
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    int r = mt * 16 + g + 8 * half;
                    if (r >= rows) continue;
                    unsigned lo = f32_to_bf16(acc[mt][nt][2 * half]), hi = f32_to_bf16(acc[mt][nt][2 * half + 1]);
                    *(unsigned*)&C[((long)e * cap + m0 + r) * N + col] = lo | (hi << 16);
                }
            }
        }
    }
}

}  // extern "C"
