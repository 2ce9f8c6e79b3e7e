// Router GEMMs with one fixed order of summation: deterministic mode's (a token's logits the
// same bits alone and in any batch) and the low-latency graph's over the live rows, both f32 fma
// partial sums over fixed column blocks added in order. (Compiled after common.cu.)

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

}  // extern "C"
