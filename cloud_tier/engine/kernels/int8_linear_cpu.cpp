// Weight-only INT8 products for decode-size batches: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k], with
// w int8 [N, K] (per-output-channel symmetric) and x, y float32 or bfloat16. A decode step reads every
// weight once and does little arithmetic per byte, so the time is the weight bytes: here one byte per
// weight where the dense product reads two (bfloat16) or four (float32). Each int8 row is widened to
// float32 in registers (sixteen lanes, cascade::vec: one AVX-512 register or two AVX2 ones, whatever
// -march=native gave) and multiplied into up to four rows of x at once, four output channels at a time
// (sixteen independent accumulators: the FMAs' latency hidden). The channels are shared out across
// threads with at::parallel_for. Prefill-size batches are compute-bound: the caller runs them dense.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

namespace vec = cascade::vec;
using vec::W;

// sixteen int8 weights as float32 lanes: one sign-extend and one convert per register of the ISA this
// was built for (GCC scalarizes __builtin_convertvector from int8: 64 scalar converts)
inline vec::fv widen(const int8_t* p) {
  vec::fv v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
#else
  for (int64_t j = 0; j < W; ++j) v[j] = static_cast<float>(p[j]);
#endif
  return v;
}

constexpr int64_t NT = 4;  // output channels per tile

// MT rows of xf (float32, [M, K], row stride K) times channels [n0, n0 + nt) of w: raw sums into acc[m][j]
template <int MT>
inline void tile(const float* xf, const int8_t* w, int64_t K, int64_t n0, int64_t nt, float acc[MT][NT]) {
  vec::fv a[MT][NT] = {};
  const int8_t* rows[NT];
  for (int64_t j = 0; j < NT; ++j) rows[j] = w + (n0 + std::min(j, nt - 1)) * K;  // a short tile repeats its last
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    if ((k & 63) == 0)  // the next tile's rows, a line each per 64 weights: the streamer sees 4 strided streams
      for (int64_t j = 0; j < NT; ++j) __builtin_prefetch(rows[j] + NT * K + k + 256);
    vec::fv wv[NT];
    for (int64_t j = 0; j < NT; ++j) wv[j] = widen(rows[j] + k);
    for (int m = 0; m < MT; ++m) {
      const vec::fv xv = vec::load(xf + m * K + k);
      for (int64_t j = 0; j < NT; ++j) a[m][j] += xv * wv[j];
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int64_t j = 0; j < NT; ++j) {
      float s = vec::sum(a[m][j]);
      for (int64_t t = k; t < K; ++t) s += xf[m * K + t] * static_cast<float>(rows[j][t]);
      acc[m][j] = s;
    }
  }
}

// rows [m0, m0 + MT) of the output at channels [n0, n0 + nt): scaled, biased, stored in T
template <typename T, int MT>
inline void tile_out(const float* xf, const int8_t* w, const float* scale, const float* bias,
                     typename cascade::Val<T>::raw* y, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t nt) {
  float acc[MT][NT];
  tile<MT>(xf + m0 * K, w, K, n0, nt, acc);
  for (int m = 0; m < MT; ++m)
    for (int64_t j = 0; j < nt; ++j)
      y[(m0 + m) * N + n0 + j] = cascade::Val<T>::st(acc[m][j] * scale[n0 + j] + (bias ? bias[n0 + j] : 0.f));
}

template <typename T>
void product(const float* xf, const int8_t* w, const float* scale, const float* bias, typename cascade::Val<T>::raw* y,
             int64_t M, int64_t K, int64_t N) {
  // channels per task: a multiple of the tile, at least ~64 KiB of weights (a thread wake-up is microseconds)
  const int64_t grain = std::max<int64_t>(NT, (65536 / std::max<int64_t>(1, K) + NT - 1) / NT * NT);
  at::parallel_for(0, (N + NT - 1) / NT, std::max<int64_t>(1, grain / NT), [&](int64_t tb, int64_t te) {
    for (int64_t n0 = tb * NT; n0 < std::min(N, te * NT); n0 += NT) {
      const int64_t nt = std::min(NT, N - n0);
      // every row of x against this tile while its weights are in L1: the weights leave memory once
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile_out<T, 4>(xf, w, scale, bias, y, K, N, m, n0, nt);
      switch (M - m) {
        case 3: tile_out<T, 3>(xf, w, scale, bias, y, K, N, m, n0, nt); break;
        case 2: tile_out<T, 2>(xf, w, scale, bias, y, K, N, m, n0, nt); break;
        case 1: tile_out<T, 1>(xf, w, scale, bias, y, K, N, m, n0, nt); break;
        default: break;
      }
    }
  });
}

}  // namespace

// x [M, K] float32 or bfloat16 (contiguous), w int8 [N, K], scale float32 [N], bias (x's dtype or
// float32) [N] or None: x @ (w * scale[:, None]).T + bias, in x's dtype, accumulated in float32
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar && w.size(1) == x.size(1),
              "w: contiguous int8 [N, K]");
  TORCH_CHECK(scale.dim() == 1 && scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.size(0) == w.size(0),
              "scale: float32 [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias: [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const torch::Tensor xf = x.to(at::kFloat).contiguous();  // widened once: every channel reads it
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    product<float>(xf.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N);
  } else {
    product<c10::BFloat16>(xf.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(), bp,
                           reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N);
  }
  return y;
}

// out [N, K] (float32 or bfloat16, contiguous) = w * scale[:, None], rounded once: the dense path's
// weight for prefill-size batches, written into a buffer the caller reuses
void int8_dequantize_(torch::Tensor& out, const torch::Tensor& w, const torch::Tensor& scale) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar, "w: contiguous int8 [N, K]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == w.sizes(), "out: contiguous, w's shape");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "scale: float32 [N]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  char* op = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K)), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* row = wp + n * K;
      const float s = sp[n];
      int64_t k = 0;
      if (bf16) {
        uint16_t* o = reinterpret_cast<uint16_t*>(op) + n * K;
        for (; k + W <= K; k += W) vec::store(o + k, widen(row + k) * s);
        for (; k < K; ++k) o[k] = cascade::Val<c10::BFloat16>::st(static_cast<float>(row[k]) * s);
      } else {
        float* o = reinterpret_cast<float*>(op) + n * K;
        for (; k + W <= K; k += W) vec::store(o + k, widen(row + k) * s);
        for (; k < K; ++k) o[k] = static_cast<float>(row[k]) * s;
      }
    }
  });
}

void register_int8_linear(pybind11::module& m) {
  m.def("int8_dequantize_", &int8_dequantize_, "out = w_int8 * scale[:, None] in out's dtype",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_linear", &int8_linear, "x @ (w_int8 * scale).T (+ bias): weight-only int8, decode-size batches",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale"), pybind11::arg("bias") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
