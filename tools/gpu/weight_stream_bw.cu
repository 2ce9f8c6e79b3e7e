// How fast DRAM streams an expert GEMM's weight tiles, by layout and by bytes in flight: each
// block reads 64-row by 128-byte boxes of a [rows, K] byte matrix (a tile's stages, k-block by
// k-block), either from the row-major layout the GEMMs read (a box is 64 runs of 128 bytes, K
// apart) or from boxes stored whole (8 KiB each), DEPTH boxes a thread's loads at a time, at 1
// to 8 blocks of 256 threads an SM. Prints GB/s, the best of nine runs of each.
//   nvcc -O3 -arch=sm_90a -o /tmp/weight_stream_bw tools/gpu/weight_stream_bw.cu && /tmp/weight_stream_bw
#include <cstdio>
#include <cuda_runtime.h>

template <bool WHOLE_BOXES, int DEPTH>
__global__ void stream_boxes(const uint4* __restrict__ w, long rows, long K, unsigned* sink) {
    const long k_blocks = K / 128, tiles = rows / 64;
    unsigned acc = 0;
    for (long t = blockIdx.x; t < tiles; t += gridDim.x) {
        for (long kb0 = 0; kb0 < k_blocks; kb0 += DEPTH) {
            uint4 v[DEPTH][2];
#pragma unroll
            for (int d = 0; d < DEPTH; d++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int i = threadIdx.x + 256 * j;  // the box's 16-byte piece
                    const long kb = kb0 + d;
                    const long at = WHOLE_BOXES ? (t * k_blocks + kb) * 8192 + i * 16
                                                : (t * 64 + i / 8) * K + kb * 128 + (i % 8) * 16;
                    v[d][j] = kb < k_blocks ? w[at / 16] : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int d = 0; d < DEPTH; d++)
#pragma unroll
                for (int j = 0; j < 2; j++) acc ^= v[d][j].x ^ v[d][j].y ^ v[d][j].z ^ v[d][j].w;
        }
    }
    if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

template <bool WHOLE_BOXES, int DEPTH>
double gb_per_s(const uint4* w, long rows, long K, unsigned* sink, int blocks) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    stream_boxes<WHOLE_BOXES, DEPTH><<<blocks, 256>>>(w, rows, K, sink);
    float best = 1e30f;
    for (int r = 0; r < 9; r++) {
        cudaEventRecord(a);
        stream_boxes<WHOLE_BOXES, DEPTH><<<blocks, 256>>>(w, rows, K, sink);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        best = ms < best ? ms : best;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return rows * K / (best * 1e-3) / 1e9;
}

int main() {
    // DeepSeek-V3's shapes: nine up projections (eight experts and the shared one, 4096 rows of
    // 7168), then eight down projections (7168 rows of 2048).
    const long K = 7168, rows = 9 * 4096, K2 = 2048, rows2 = 8 * 7168;
    uint4* w;
    unsigned* sink;
    if (cudaMalloc(&w, rows * K) != cudaSuccess || cudaMalloc(&sink, 4) != cudaSuccess) {
        fprintf(stderr, "weight_stream_bw: no GPU memory\n");
        return 1;
    }
    cudaMemset(w, 1, rows * K);
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    printf("blocks (KiB in flight an SM at depth 4 / 8): row-major depth 4, 8; whole boxes depth 4, 8 (GB/s)\n");
    for (int per : {1, 2, 4, 8}) {
        const int blocks = sms * per;
        printf("K %ld, %4d blocks (%3d / %3d KiB): %6.0f %6.0f   %6.0f %6.0f\n", K, blocks, 32 * per, 64 * per,
               gb_per_s<false, 4>(w, rows, K, sink, blocks), gb_per_s<false, 8>(w, rows, K, sink, blocks),
               gb_per_s<true, 4>(w, rows, K, sink, blocks), gb_per_s<true, 8>(w, rows, K, sink, blocks));
    }
    for (int per : {1, 2, 4}) {
        const int blocks = sms * per;
        printf("K %ld, %4d blocks (%3d KiB): %6.0f          %6.0f\n", K2, blocks, 32 * per,
               gb_per_s<false, 4>(w, rows2, K2, sink, blocks), gb_per_s<true, 4>(w, rows2, K2, sink, blocks));
    }
    return 0;
}
