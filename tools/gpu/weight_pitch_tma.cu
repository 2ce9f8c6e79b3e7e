// How fast TMA streams an expert GEMM's weight tiles, by the weights' row pitch: one block an SM
// keeps a ring of STAGES stages in flight, each stage two boxes of 64 rows by 128 bytes (the
// 64-row fp8 tiles' weight stage: 128 weight rows, one 128-deep k-block), tile by tile over
// 128-row tiles of a [rows, K] byte matrix whose rows lie `pitch` bytes apart. Nothing reads the
// stages: only the loads are timed. Prints GB/s of the K bytes a row, the best of nine runs.
//   nvcc -O3 -arch=sm_90a -o /tmp/weight_pitch_tma tools/gpu/weight_pitch_tma.cu -lcuda && /tmp/weight_pitch_tma
#include <cstdint>
#include <cstdio>
#include <cuda.h>
#include <cuda_runtime.h>

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int STAGES>
__global__ void __launch_bounds__(32) tma_stream(const __grid_constant__ CUtensorMap map, int tiles, int k_blocks) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t full[STAGES];
    unsigned char* ring = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    if (threadIdx.x != 0) return;
    for (int s = 0; s < STAGES; s++)
        asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_addr(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    long issued = 0;
    const long total = (long)((tiles - blockIdx.x + gridDim.x - 1) / gridDim.x) * k_blocks;
    int t = blockIdx.x, kb = 0;
    for (long step = 0; step < total + STAGES; step++) {
        const int s = step % STAGES;
        if (step >= STAGES) {  // wait for the load issued into this slot STAGES steps ago
            const uint32_t parity = ((step / STAGES) - 1) & 1;
            uint32_t done = 0;
            while (!done)
                asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                             : "=r"(done)
                             : "r"(smem_addr(&full[s])), "r"(parity)
                             : "memory");
        }
        if (issued < total) {
            const uint32_t bar = smem_addr(&full[s]);
            asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], 16384;" ::"r"(bar) : "memory");
            for (int h = 0; h < 2; h++) {
                const uint32_t dst = smem_addr(ring + s * 16384 + h * 8192);
                const int x = kb * 128, y = t * 128 + h * 64;
                asm volatile(
                    "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                    "l"(&map), "r"(x), "r"(y), "r"(bar)
                    : "memory");
            }
            issued++;
            if (++kb == k_blocks) {
                kb = 0;
                t += gridDim.x;
            }
        }
    }
}

static CUtensorMap make_map(void* ptr, long rows, long K, long pitch) {
    CUtensorMap map;
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)pitch};
    cuuint32_t box[2] = {128, 64}, unit[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, ptr, dims, strides, box, unit,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", (int)r);
    return map;
}

template <int STAGES>
double gb_per_s(void* w, long rows, long K, long pitch, int blocks) {
    const CUtensorMap map = make_map(w, rows, K, pitch);
    const int smem = STAGES * 16384 + 1024;
    cudaFuncSetAttribute(tma_stream<STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    const int tiles = rows / 128, k_blocks = K / 128;
    tma_stream<STAGES><<<blocks, 32, smem>>>(map, tiles, k_blocks);
    float best = 1e30f;
    for (int r = 0; r < 9; r++) {
        cudaEventRecord(a);
        tma_stream<STAGES><<<blocks, 32, smem>>>(map, tiles, k_blocks);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        best = ms < best ? ms : best;
    }
    if (cudaGetLastError() != cudaSuccess) fprintf(stderr, "launch failed\n");
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return rows * K / (best * 1e-3) / 1e9;
}

int main() {
    cuInit(0);
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    // DeepSeek-V3's shapes at one token: the up projections of eight experts and the shared one
    // (4096 rows of 7168), the down projections' (7168 rows of 2048) of as many.
    struct Shape {
        long rows, K;
    } shapes[] = {{9 * 4096, 7168}, {9 * 7168, 2048}};
    void* w;
    if (cudaMalloc(&w, 9L * 7168 * 4096 * 2) != cudaSuccess) {
        fprintf(stderr, "weight_pitch_tma: no GPU memory\n");
        return 1;
    }
    cudaMemset(w, 1, 9L * 7168 * 4096 * 2);
    printf("GB/s, one block an SM (%d), ring of 6 / 9 / 13 stages of 16 KiB\n", sms);
    for (const Shape& s : shapes)
        for (long pad : {0L, 128L, 256L, 512L, 1024L, 2048L}) {
            const long pitch = s.K + pad;
            printf("K %5ld pitch %5ld: %6.0f %6.0f %6.0f\n", s.K, pitch, gb_per_s<6>(w, s.rows, s.K, pitch, sms),
                   gb_per_s<9>(w, s.rows, s.K, pitch, sms), gb_per_s<13>(w, s.rows, s.K, pitch, sms));
        }
    return 0;
}
