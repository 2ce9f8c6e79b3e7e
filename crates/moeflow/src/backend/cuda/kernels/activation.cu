// The experts' activations: act(gate) · up for each kind, as a pass over the up projection's
// rows (the Hopper GEMMs apply act_mul in their epilogue instead). (Compiled after common.cu.)

extern "C" {

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

}  // extern "C"
