// --adam-state-precision 8bit: decode -> Adam update -> encode of each block in one pass, in cache.
//
// Built by toolkit/optim/fused_8bit.py with DeepSpeed's CPU Adam builder and flags, so the update
// is DeepSpeed's own Adam_Optimizer code (its cpu_adam_impl.cpp, included below), compiled the
// same way as DeepSpeed's op. The codec is the one of toolkit/optim/quantized_states.py, to the
// bit: the two transcendental steps there (exp2 when decoding exp_avg_sq, log2 when encoding it)
// are taken from torch itself, as a 256-entry table of decoded ratios and the 254 smallest ratios
// of each code (computed in Python with the eager ops); every other step is one IEEE operation
// (*, /, sqrt, round-half-even, max) done in the eager order.
//
// What the eager path does per slice of whole rows, DeepSpeed's op on fp32 copies of the moments
// (its SIMD body, then its scalar code for the last numel % SIMD_WIDTH values of the slice), this
// does per block: the values the eager path gives to the scalar code get it here too (`span_rows`
// is the eager slice height), the others go through the SIMD body, on zero-padded buffers when a
// block is not a multiple of SIMD_WIDTH.
#include "cpu_adam_impl.cpp"

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512__) || defined(__AVX256__) || defined(__NEON__)
constexpr int64_t kSimd = SIMD_WIDTH;  // DeepSpeed's op: a SIMD body, a scalar tail
#else
constexpr int64_t kSimd = 1;  // scalar build, or SVE (predicated, no tail): one code path for every value
#endif
constexpr float kTiny = std::numeric_limits<float>::min();  // torch.finfo(float32).tiny

struct Codec {
    const float* ratio;       // [256]: exp_avg_sq code k -> v / vmax (k >= 1; quantized_states.SQ_RATIO)
    const float* threshold;   // [256]: k >= 2 -> the smallest v / vmax coded k or more (SQ_THRESHOLD)
};

// The exp_avg_sq code of r = v / vmax (0 <= r <= 1). A first guess from r's exponent and mantissa:
// e + f (mantissa 1 + f) is log2(r) less 0 to 0.087, i.e. 0 to 0.55 of a code, and 0.01 of a code
// less again covers the float rounding of the multiply, so the code is the guess or the next one:
// one look at the next code's threshold decides. Tiny, denormal and zero ratios guess 2 (clamped)
// and fall to 1 below threshold[2] (about 1e-12). Branch-free: one table read per value.
constexpr float kCodesPerOctave = 6.35f;  // 127 / SQ_OCTAVES
constexpr float kGuessMargin = 0.01f;

inline int sq_code(float r, const Codec& c)
{
    int32_t bits;
    std::memcpy(&bits, &r, sizeof bits);
    int32_t mant = (bits & 0x7fffff) | 0x3f800000;
    float frac;
    std::memcpy(&frac, &mant, sizeof frac);
    float log2_guess = static_cast<float>((bits >> 23) - 127) + (frac - 1.0f);
    int k = static_cast<int>(std::nearbyint(log2_guess * kCodesPerOctave - kGuessMargin)) + 255;
    k = std::min(255, std::max(2, k));
    float t_up = c.threshold[std::min(k + 1, 255)];
    return k + static_cast<int>((k < 255) & (r >= t_up)) - static_cast<int>(r < c.threshold[2]);
}

// One block's fp32 moments, parameters and gradients, laid out for DeepSpeed's op: values
// [0, body) at 0 (zero-padded to a multiple of kSimd), values [body, len) at `tail_at`.
struct Scratch {
    std::vector<float> p, g, m, v;
    explicit Scratch(int64_t block) : p(block + 2 * kSimd), g(p.size()), m(p.size()), v(p.size()) {}
};

struct Segment {
    int64_t from, count, at;  // block values [from, from + count) live at scratch index `at`
};

#if defined(__AVX2__)
// The vector forms of the decoding and the two encoding loops below, 8 values at a time: the same IEEE operations
// in the same order (a rounding is _mm256_round_ps to nearest-even, as std::nearbyint); both return
// how many values they did, the scalar loops do the rest.
inline void store_codes(uint8_t* out, __m256i k)  // 8 values in [0, 255]
{
    __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(halves, halves));
}

inline void store_codes(int8_t* out, __m256i k)  // 8 values in [-127, 127]
{
    __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(halves, halves));
}

inline __m256i load8(const void* p) { return _mm256_castsi128_si256(_mm_loadl_epi64(static_cast<const __m128i*>(p))); }

int64_t decode8(const uint8_t* vc, const int8_t* rc, float* wv, float* wm, int64_t count, float r_scale, float vmax,
                const Codec& c)
{
    const __m256 vm = _mm256_set1_ps(vmax), rs = _mm256_set1_ps(r_scale);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i k = _mm256_cvtepu8_epi32(_mm256_castsi256_si128(load8(vc + i)));
        __m256 v = _mm256_mul_ps(_mm256_i32gather_ps(c.ratio, k, 4), vm);
        v = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, _mm256_setzero_si256())));
        _mm256_storeu_ps(wv + i, v);
        __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm256_castsi256_si128(load8(rc + i))));
        _mm256_storeu_ps(wm + i, _mm256_mul_ps(_mm256_mul_ps(code, rs), _mm256_sqrt_ps(v)));
    }
    return i;
}

inline __m256i sq_code8(__m256 r, const Codec& c)
{
    const __m256i bits = _mm256_castps_si256(r);
    __m256 exponent = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
    __m256i mant = _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff)), _mm256_set1_epi32(0x3f800000));
    __m256 guess = _mm256_add_ps(exponent, _mm256_sub_ps(_mm256_castsi256_ps(mant), _mm256_set1_ps(1.0f)));
    __m256 scaled = _mm256_round_ps(_mm256_sub_ps(_mm256_mul_ps(guess, _mm256_set1_ps(kCodesPerOctave)),
                                                  _mm256_set1_ps(kGuessMargin)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i k = _mm256_add_epi32(_mm256_cvtps_epi32(scaled), _mm256_set1_epi32(255));
    k = _mm256_min_epi32(_mm256_max_epi32(k, _mm256_set1_epi32(2)), _mm256_set1_epi32(255));
    __m256i up = _mm256_min_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(1)), _mm256_set1_epi32(255));
    __m256 t_up = _mm256_i32gather_ps(c.threshold, up, 4);
    __m256i inc = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(255), k),
                                   _mm256_castps_si256(_mm256_cmp_ps(r, t_up, _CMP_GE_OQ)));
    __m256i dec = _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_set1_ps(c.threshold[2]), _CMP_LT_OQ));
    return _mm256_add_epi32(_mm256_sub_epi32(k, inc), dec);  // masks are -1: k + 1 and k - 1
}

int64_t encode_sq8(float* wv, float* wm, uint8_t* vc, int64_t count, float vmax, float denom, const Codec& c)
{
    const __m256 vm = _mm256_set1_ps(vmax), dn = _mm256_set1_ps(denom), tiny = _mm256_set1_ps(kTiny);
    const __m256 zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256 v = _mm256_loadu_ps(wv + i);
        __m256i k = _mm256_and_si256(sq_code8(_mm256_div_ps(v, dn), c),
                                     _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_GT_OQ)));
        store_codes(vc + i, k);
        __m256 decoded = _mm256_sqrt_ps(_mm256_mul_ps(_mm256_i32gather_ps(c.ratio, k, 4), vm));
        __m256i coded = _mm256_cmpgt_epi32(k, _mm256_setzero_si256());
        __m256 root = _mm256_and_ps(decoded, _mm256_castsi256_ps(coded));
        __m256 r = _mm256_div_ps(_mm256_loadu_ps(wm + i), _mm256_max_ps(root, tiny));
        _mm256_storeu_ps(wm + i, _mm256_and_ps(r, _mm256_cmp_ps(root, zero, _CMP_GT_OQ)));
    }
    return i;
}

int64_t sq_codes8(const float* ratios, uint8_t* out, int64_t count, const Codec& c)
{
    const int64_t end = count / 8 * 8;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < end; i += 8) {
        __m256 r = _mm256_loadu_ps(ratios + i);
        store_codes(out + i, _mm256_and_si256(sq_code8(r, c), _mm256_castps_si256(
                                                 _mm256_cmp_ps(r, _mm256_setzero_ps(), _CMP_GT_OQ))));
    }
    return end;
}

int64_t encode_signed8(const float* wm, int8_t* rc, int64_t count, float scale)
{
    const __m256 sc = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(wm + i), sc),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        store_codes(rc + i, _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi)));
    }
    return i;
}
#else
int64_t decode8(const uint8_t*, const int8_t*, float*, float*, int64_t, float, float, const Codec&) { return 0; }
int64_t encode_sq8(float*, float*, uint8_t*, int64_t, float, float, const Codec&) { return 0; }
int64_t encode_signed8(const float*, int8_t*, int64_t, float) { return 0; }
int64_t sq_codes8(const float*, uint8_t*, int64_t, const Codec&) { return 0; }
#endif

template <typename G>
void decode(const Segment& s, const float* param, const G* grad, const int8_t* r_codes, const uint8_t* v_codes,
            float r_scale, float vmax, float grad_scale, bool scaled, const Codec& c, Scratch& w)
{
    const float* ratio = c.ratio;
    float* wv = w.v.data() + s.at;
    float* wm = w.m.data() + s.at;
    float* wg = w.g.data() + s.at;
    const uint8_t* vc = v_codes + s.from;
    const int8_t* rc = r_codes + s.from;
    const G* gr = grad + s.from;
    std::memcpy(w.p.data() + s.at, param + s.from, s.count * sizeof(float));
    for (int64_t i = decode8(vc, rc, wv, wm, s.count, r_scale, vmax, c); i < s.count; ++i) {
        int k = vc[i];
        float decoded = ratio[k] * vmax;  // ratio[0] is 0; code 0 is v = 0 even where vmax is inf
        float v = k ? decoded : 0.0f;
        wv[i] = v;
        wm[i] = static_cast<float>(rc[i]) * r_scale * std::sqrt(v);
    }
    if (scaled) {
#pragma omp simd
        for (int64_t i = 0; i < s.count; ++i) wg[i] = static_cast<float>(gr[i]) * grad_scale;
    } else {
#pragma omp simd
        for (int64_t i = 0; i < s.count; ++i) wg[i] = static_cast<float>(gr[i]);
    }
}

// max(0, x...) of the two segments of a scratch buffer (of |x| when `absolute`), NaN if any x is NaN
// (as torch.amax; the 0 stands for the eager path's zero padding).
float block_max(const Segment* segs, const float* x, bool absolute)
{
    float best = 0.0f;
    int nan = 0;
    for (int s = 0; s < 2; ++s) {
        const float* y = x + segs[s].at;
#pragma omp simd reduction(max : best) reduction(| : nan)
        for (int64_t i = 0; i < segs[s].count; ++i) {
            float a = absolute ? std::fabs(y[i]) : y[i];
            nan |= static_cast<int>(a != a);
            best = std::max(best, a);
        }
    }
    return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

// exp_avg_sq's codes of the updated v (returns the block's max v); the m buffer becomes r = m / sqrt(v as coded).
float encode_sq(const Segment* segs, uint8_t* v_codes, const Codec& c, Scratch& w)
{
    float vmax = block_max(segs, w.v.data(), false);
    float denom = std::max(vmax, kTiny);
    const float* ratio = c.ratio;
    for (int s = 0; s < 2; ++s) {
        float* wv = w.v.data() + segs[s].at;
        float* wm = w.m.data() + segs[s].at;
        uint8_t* vc = v_codes + segs[s].from;
        for (int64_t i = encode_sq8(wv, wm, vc, segs[s].count, vmax, denom, c); i < segs[s].count; ++i) {
            float v = wv[i];
            int coded = sq_code(v / denom, c);
            int k = v > 0.0f ? coded : 0;
            vc[i] = static_cast<uint8_t>(k);
            float decoded = std::sqrt(ratio[k] * vmax);
            float root = k ? decoded : 0.0f;
            float r = wm[i] / std::max(root, kTiny);
            wm[i] = root > 0.0f ? r : 0.0f;
        }
    }
    return vmax;
}

// exp_avg's linear codes of r (the m buffer after encode_sq); returns the block's max |r|.
float encode_signed(const Segment* segs, int8_t* r_codes, Scratch& w)
{
    float amax = block_max(segs, w.m.data(), true);
    float scale = std::max(amax / 127.0f, kTiny);
    for (int s = 0; s < 2; ++s) {
        const float* wm = w.m.data() + segs[s].at;
        int8_t* rc = r_codes + segs[s].from;
        for (int64_t i = encode_signed8(wm, rc, segs[s].count, scale); i < segs[s].count; ++i) {
            float q = std::nearbyint(wm[i] / scale);
            rc[i] = static_cast<int8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, q))));
        }
    }
    return amax;
}

struct Step {
    Adam_Optimizer* opt;
    const Codec* codec;
    float grad_scale;
    bool scaled;
};

// One block: values [start, start + len) of row `row`; values from `tail_from` on (within the block)
// are the eager slice's scalar tail.
template <typename G>
void block_step(const Step& st, float* param, const G* grad, int8_t* r_codes, uint8_t* v_codes, float* r_absmax,
                float* v_absmax, int64_t len, int64_t tail_from, Scratch& w)
{
    int64_t body = std::min(len, std::max<int64_t>(0, tail_from));
    int64_t padded = (body + kSimd - 1) / kSimd * kSimd;
    Segment segs[2] = {{0, body, 0}, {body, len - body, padded}};
    std::fill(w.p.begin() + body, w.p.begin() + padded, 0.0f);
    std::fill(w.g.begin() + body, w.g.begin() + padded, 0.0f);
    std::fill(w.m.begin() + body, w.m.begin() + padded, 0.0f);
    std::fill(w.v.begin() + body, w.v.begin() + padded, 0.0f);
    float r_scale = *r_absmax / 127.0f;
    for (const Segment& s : segs)
        decode(s, param, grad, r_codes, v_codes, r_scale, *v_absmax, st.grad_scale, st.scaled, *st.codec, w);
    if (padded) st.opt->Step_8(w.p.data(), w.g.data(), w.m.data(), w.v.data(), padded, false);
    if (len > body)  // fewer than kSimd values: DeepSpeed's scalar code
        st.opt->Step_1(w.p.data() + padded, w.g.data() + padded, w.m.data() + padded, w.v.data() + padded,
                       len - body, false);
    for (const Segment& s : segs) std::memcpy(param + s.from, w.p.data() + s.at, s.count * sizeof(float));
    *v_absmax = encode_sq(segs, v_codes, *st.codec, w);
    *r_absmax = encode_signed(segs, r_codes, w);
}

template <typename G>
void all_blocks(const Step& st, float* param, const G* grad, int8_t* r_codes, uint8_t* v_codes, float* r_absmax,
                float* v_absmax, int64_t rows, int64_t cols, int64_t block, int64_t span_rows)
{
    const int64_t n = (cols + block - 1) / block;
    const int64_t width = (cols + n - 1) / n;  // quantized_states.row_blocks
    const int64_t tasks = rows * n;
#pragma omp parallel
    {
        Scratch w(width);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; ++t) {
            int64_t row = t / n, j = t % n;
            int64_t col = j * width, len = std::min(width, cols - col);
            // the eager slice holding this row: rows [r0, r1), its scalar tail starts at value `tail`
            int64_t r0 = row / span_rows * span_rows, r1 = std::min(rows, r0 + span_rows);
            int64_t slice = (r1 - r0) * cols, tail = slice - slice % kSimd;
            int64_t here = (row - r0) * cols + col;  // this block's first value within the slice
            int64_t off = row * cols + col;
            block_step(st, param + off, grad + off, r_codes + off, v_codes + off, r_absmax + t, v_absmax + t, len,
                       tail - here, w);
        }
    }
}

void check(bool ok, const char* what)
{
    if (!ok) throw std::invalid_argument(std::string("adam_8bit_step: ") + what);
}

}  // namespace

// One AdamW step of a (rows, cols) fp32 parameter with 8-bit moments, in place; `block` is
// quantized_states.BLOCK, `span_rows` the eager path's rows per slice.
void adam_8bit_step(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                    torch::Tensor exp_avg_absmax, torch::Tensor exp_avg_sq_absmax, torch::Tensor ratio,
                    torch::Tensor threshold, int64_t block, int64_t span_rows, int64_t step, float lr,
                    float beta1, float beta2, float eps, float weight_decay, bool bias_correction,
                    double grad_scale)
{
    check(param.dim() == 2 && param.scalar_type() == torch::kFloat32 && param.is_contiguous(), "param");
    int64_t rows = param.size(0), cols = param.size(1), n = (cols + block - 1) / block;
    check(grad.sizes() == param.sizes() && grad.is_contiguous(), "grad");
    check(exp_avg.scalar_type() == torch::kInt8 && exp_avg.numel() == param.numel() && exp_avg.is_contiguous(),
          "exp_avg");
    check(exp_avg_sq.scalar_type() == torch::kUInt8 && exp_avg_sq.numel() == param.numel() &&
              exp_avg_sq.is_contiguous(), "exp_avg_sq");
    for (const auto& a : {exp_avg_absmax, exp_avg_sq_absmax})
        check(a.scalar_type() == torch::kFloat32 && a.numel() == rows * n && a.is_contiguous(), "absmax");
    check(ratio.numel() == 256 && threshold.numel() == 256 && ratio.scalar_type() == torch::kFloat32 &&
              threshold.scalar_type() == torch::kFloat32, "tables");
    check(block > 0 && span_rows > 0, "block/span_rows");
    if (param.numel() == 0) return;

    // DeepSpeed's own bias correction, as the eager path primes it (a call at step + 2, then step: pow)
    Adam_Optimizer opt(lr, beta1, beta2, eps, weight_decay, true);
    opt.IncrementStep(step + 2, beta1, beta2);
    opt.IncrementStep(step, beta1, beta2);
    opt.update_state(lr, eps, weight_decay, bias_correction);
    Codec codec{ratio.data_ptr<float>(), threshold.data_ptr<float>()};
    Step st{&opt, &codec, static_cast<float>(grad_scale), grad_scale != 1.0};
    auto* p = param.data_ptr<float>();
    auto* rc = exp_avg.data_ptr<int8_t>();
    auto* vc = exp_avg_sq.data_ptr<uint8_t>();
    auto* ra = exp_avg_absmax.data_ptr<float>();
    auto* va = exp_avg_sq_absmax.data_ptr<float>();
    switch (grad.scalar_type()) {
        case torch::kFloat32:
            all_blocks(st, p, grad.data_ptr<float>(), rc, vc, ra, va, rows, cols, block, span_rows);
            break;
        case torch::kBFloat16:
            all_blocks(st, p, grad.data_ptr<c10::BFloat16>(), rc, vc, ra, va, rows, cols, block, span_rows);
            break;
        case torch::kFloat16:
            all_blocks(st, p, grad.data_ptr<c10::Half>(), rc, vc, ra, va, rows, cols, block, span_rows);
            break;
        default: check(false, "grad dtype (float32, bfloat16 or float16)");
    }
}

// The exp_avg_sq codes of ratios v / vmax (0 for a ratio <= 0), as the kernel computes them: for tests.
torch::Tensor sq_codes(torch::Tensor ratios, torch::Tensor ratio, torch::Tensor threshold)
{
    check(ratios.scalar_type() == torch::kFloat32 && ratios.is_contiguous(), "ratios");
    auto out = torch::empty(ratios.sizes(), torch::kUInt8);
    Codec codec{ratio.data_ptr<float>(), threshold.data_ptr<float>()};
    const float* r = ratios.data_ptr<float>();
    uint8_t* o = out.data_ptr<uint8_t>();
    const int64_t n = ratios.numel();
    const int64_t vector_end = sq_codes8(r, o, n, codec);  // the kernel's vector path, then its scalar one
    for (int64_t i = vector_end; i < n; ++i) o[i] = static_cast<uint8_t>(r[i] > 0.0f ? sq_code(r[i], codec) : 0);
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("sq_codes", &sq_codes, "exp_avg_sq codes of v / vmax ratios (the kernel's encoder)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("adam_8bit_step", &adam_8bit_step, "AdamW step with blockwise 8-bit moments (GIL released)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("simd_width", []() { return kSimd; }, "values per SIMD step of DeepSpeed's update (1: no scalar tail)");
}
