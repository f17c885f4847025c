// The element-wise parts of a decoder layer on CPU, each one pass over its rows (torch runs each as
// several ops, every one a pass over memory and a wake-up of its threads): RMSNorm (Llama's and
// Gemma's), the residual add fused with the next RMSNorm, SiLU/GELU(tanh) times up, and RoPE in
// place. Numerics follow the torch path they replace: float32 math, rounded to the storage type
// wherever torch (and HF) store an intermediate in it. float32 and bfloat16 run sixteen lanes at a
// time (cascade::vec; GCC left the bfloat16 stores and the argmax scalar: 3-15x slower at a decode
// batch of 200), float16 and the rows' tails one element at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

namespace {

using cascade::Val;
using cascade::round_to;

// rows per task so a task touches at least ~32K elements (one row at a time runs inline)
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

template <typename T> using raw_t = typename Val<T>::raw;
using cascade::vec::W;
namespace vec = cascade::vec;

// the sum of squares of x[0..D), sixteen lanes at a time where T has a vector path
template <typename T> inline float sum_sq(const raw_t<T>* x, int64_t D) {
  int64_t d = 0;
  float ss = 0.f;
  if constexpr (vec::has<T>) {
    vec::fv acc{};
    for (; d + W <= D; d += W) {
      const vec::fv v = vec::load(x + d);
      acc += v * v;
    }
    ss = vec::sum(acc);
  }
  for (; d < D; ++d) ss += Val<T>::ld(x[d]) * Val<T>::ld(x[d]);
  return ss;
}

// out = x normalized by r (1 / its RMS) and weighted: Gemma's (x * r * (1 + w)) in float32, then
// stored; Llama's w * (x * r stored in T), the product stored in T
template <typename T> inline void scale_row(const raw_t<T>* x, const raw_t<T>* w, raw_t<T>* out, int64_t D, float r,
                                            bool offset) {
  int64_t d = 0;
  if constexpr (vec::has<T>) {
    for (; d + W <= D; d += W) {
      const vec::fv v = vec::load(x + d), wv = vec::load(w + d);
      vec::store(out + d, offset ? v * r * (1.f + wv) : wv * vec::round<T>(v * r));
    }
  }
  for (; d < D; ++d) {
    const float v = Val<T>::ld(x[d]), wv = Val<T>::ld(w[d]);
    out[d] = Val<T>::st(offset ? v * r * (1.f + wv) : wv * round_to<T>(v * r));
  }
}

template <typename T>
inline void norm_row(const raw_t<T>* x, const raw_t<T>* w, raw_t<T>* out, int64_t D, float eps, bool offset) {
  scale_row<T>(x, w, out, D, 1.f / std::sqrt(sum_sq<T>(x, D) / static_cast<float>(D) + eps), offset);
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x: [N, D] or [N, heads, D]");
  TORCH_CHECK(x.stride(-1) == 1, "x: the last dim contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(-1), "weight: [D]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x of one dtype");
}

// f(T{}) for the storage type of x: float32, bfloat16 or float16
template <typename F> void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "float32, bfloat16 or float16 only, not ", t);
  }
}

}  // namespace

// RMSNorm over the last dim of x [N, D] or [N, heads, D] (the leading dims strided); returns a
// contiguous tensor. ``offset``: Gemma's weight, stored as an offset from 1.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool offset) {
  check_rows(x, weight);
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t D = x.size(-1), inner = x.dim() == 3 ? x.size(1) : 1, rows = x.size(0) * inner;
  const int64_t s0 = x.stride(0), s1 = x.dim() == 3 ? x.stride(1) : 0;
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using raw = typename Val<scalar_t>::raw;
    const raw* xp = static_cast<const raw*>(x.data_ptr());
    const raw* wp = static_cast<const raw*>(weight.data_ptr());
    raw* op = static_cast<raw*>(out.data_ptr());
    at::parallel_for(0, rows, grain(D), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        norm_row<scalar_t>(xp + (i / inner) * s0 + (i % inner) * s1, wp, op + i * D, D, static_cast<float>(eps),
                           offset);
    });
  });
  return out;
}

// residual += x (stored in its dtype, as torch's add), then Llama's RMSNorm of the sum: returns
// the normalized rows. x and residual: contiguous [N, D].
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(residual, weight);
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.scalar_type() == residual.scalar_type() && x.dim() == 2,
              "x and residual: contiguous [N, D] of one dtype");
  auto out = torch::empty_like(x);
  const int64_t D = x.size(1), rows = x.size(0);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using raw = typename Val<scalar_t>::raw;
    const raw* xp = static_cast<const raw*>(x.data_ptr());
    raw* rp = static_cast<raw*>(residual.data_ptr());
    const raw* wp = static_cast<const raw*>(weight.data_ptr());
    raw* op = static_cast<raw*>(out.data_ptr());
    at::parallel_for(0, rows, grain(D), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        raw* r = rp + i * D;
        const raw* xr = xp + i * D;
        int64_t d = 0;
        if constexpr (vec::has<scalar_t>) {
          for (; d + W <= D; d += W) vec::store(r + d, vec::load(r + d) + vec::load(xr + d));
        }
        for (; d < D; ++d) r[d] = Val<scalar_t>::st(Val<scalar_t>::ld(r[d]) + Val<scalar_t>::ld(xr[d]));
        norm_row<scalar_t>(r, wp, op + i * D, D, static_cast<float>(eps), false);
      }
    });
  });
  return out;
}

// SiLU and GELU(tanh) of a float or sixteen (one formula, so both paths round alike)
inline float exp_of(float x) { return cascade::exp_any(x); }
inline vec::fv exp_of(vec::fv x) { return vec::exp_any(x); }
template <typename F> inline F silu(F x) { return x / (1.f + exp_of(-x)); }
template <typename F> inline F gelu_tanh(F x) {
  const F y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (2.f - 2.f / (exp_of(2.f * y) + 1.f));  // 0.5 x (1 + tanh(y))
}

// act(gate) * up over [N, 2I] (gate | up): [N, I]. act 0: SiLU, 1: GELU with the tanh
// approximation. The activation is stored in the dtype before the product, as torch's two ops do.
torch::Tensor act_and_mul(torch::Tensor gate_up, int64_t act) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up: contiguous [N, 2I]");
  TORCH_CHECK(act == 0 || act == 1, "act: 0 (silu) or 1 (gelu tanh)");
  const int64_t I = gate_up.size(1) / 2, rows = gate_up.size(0);
  auto out = torch::empty({rows, I}, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using raw = typename Val<scalar_t>::raw;
    const raw* gp = static_cast<const raw*>(gate_up.data_ptr());
    raw* op = static_cast<raw*>(out.data_ptr());
    at::parallel_for(0, rows, grain(2 * I), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const raw* g = gp + i * 2 * I;
        const raw* u = g + I;
        raw* o = op + i * I;
        int64_t d = 0;
        if constexpr (vec::has<scalar_t>) {
          for (; d + W <= I; d += W) {
            const vec::fv x = vec::load(g + d);
            vec::store(o + d, vec::round<scalar_t>(act == 0 ? silu(x) : gelu_tanh(x)) * vec::load(u + d));
          }
        }
        for (; d < I; ++d) {
          const float x = Val<scalar_t>::ld(g[d]);
          o[d] = Val<scalar_t>::st(round_to<scalar_t>(act == 0 ? silu(x) : gelu_tanh(x)) * Val<scalar_t>::ld(u[d]));
        }
      }
    });
  });
  return out;
}

// RoPE in place on x [N, heads, D] (rows strided, each head's D contiguous), HF's rotate-half
// layout: x * cos + cat(-x2, x1) * sin at each row's position, cos/sin [max_pos, D] in float32 or
// x's dtype (a model moved to bfloat16 moves its tables with it). As the
// torch path: cos and sin stored in x's dtype, each product stored, then their sum.
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x: [N, heads, D], heads contiguous");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.is_contiguous() && positions.size(0) == x.size(0),
              "positions: int64 [N]");
  TORCH_CHECK((cos.dtype() == torch::kFloat32 || cos.dtype() == x.dtype()) && sin.dtype() == cos.dtype() &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == x.size(2) &&
                  sin.sizes() == cos.sizes(),
              "cos/sin: [max_pos, D] in float32 or x's dtype");
  const bool f32_tables = cos.dtype() == torch::kFloat32;
  const int64_t N = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2, s0 = x.stride(0);
  const int64_t max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "a position past the RoPE table");
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using raw = typename Val<scalar_t>::raw;
    raw* xp = static_cast<raw*>(x.data_ptr());
    const void* cp = cos.data_ptr();
    const void* sp = sin.data_ptr();
    auto table = [&](const void* t, int64_t p, int64_t d) {
      return f32_tables ? static_cast<const float*>(t)[p * D + d] : Val<scalar_t>::ld(static_cast<const raw*>(t)[p * D + d]);
    };
    at::parallel_for(0, N, grain(heads * D), [&](int64_t begin, int64_t end) {
      std::vector<float> c(D), s(D), a(D);
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t d = 0; d < D; ++d) {
          c[d] = round_to<scalar_t>(table(cp, pos[i], d));
          const float sv = table(sp, pos[i], d);
          s[d] = round_to<scalar_t>(d < half ? -sv : sv);  // the rotated first half is negated
        }
        for (int64_t h = 0; h < heads; ++h) {
          raw* v = xp + i * s0 + h * D;
          if constexpr (vec::has<scalar_t>) {
            if (half % W == 0) {  // both halves in whole vectors, each read before either is written
              for (int64_t d = 0; d < half; d += W) {
                const vec::fv lo = vec::load(v + d), hi = vec::load(v + d + half);
                vec::store(v + d, vec::round<scalar_t>(lo * vec::load(&c[d])) + vec::round<scalar_t>(hi * vec::load(&s[d])));
                vec::store(v + d + half, vec::round<scalar_t>(hi * vec::load(&c[d + half])) +
                                             vec::round<scalar_t>(lo * vec::load(&s[d + half])));
              }
              continue;
            }
          }
          for (int64_t d = 0; d < D; ++d) a[d] = Val<scalar_t>::ld(v[d]);
#pragma omp simd
          for (int64_t d = 0; d < half; ++d)
            v[d] = Val<scalar_t>::st(round_to<scalar_t>(a[d] * c[d]) + round_to<scalar_t>(a[d + half] * s[d]));
#pragma omp simd
          for (int64_t d = half; d < D; ++d)
            v[d] = Val<scalar_t>::st(round_to<scalar_t>(a[d] * c[d]) + round_to<scalar_t>(a[d - half] * s[d]));
        }
      }
    });
  });
}

// Greedy choice per row of logits [N, V] (float32, bfloat16 or float16): (token int64 [N], its
// logit float32 [N]) by numpy's argmax rule: the first maximum, NaN counted as the maximum (the
// first NaN wins). One pass reading the row as stored (no float32 copy of the whole batch); a second
// only in a row with a NaN.
std::vector<torch::Tensor> argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits: [N, V], rows contiguous");
  const int64_t N = logits.size(0), V = logits.size(1), s0 = logits.stride(0);
  TORCH_CHECK(V > 0, "an empty vocabulary");
  auto tokens = torch::empty({N}, torch::kInt64);
  auto chosen = torch::empty({N}, torch::kFloat32);
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* cp = chosen.data_ptr<float>();
  dispatch(logits.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using raw = typename Val<scalar_t>::raw;
    const raw* lp = static_cast<const raw*>(logits.data_ptr());
    at::parallel_for(0, N, grain(V), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const raw* row = lp + i * s0;
        float mx = -INFINITY;
        int64_t at = 0;  // all -inf: the first, as numpy
        bool nan = false;
        int64_t v = 0;
        if constexpr (vec::has<scalar_t>) {
          // two sets of lanes, each holding its largest value so far and where it first was (a
          // strict > keeps the first); NaN noted apart. Lanes that saw only -inf keep their first
          // index, which only matters (as 0) when the whole row is -inf.
          vec::fv m0 = vec::splat(-INFINITY), m1 = m0;
          vec::iv lane{};
          for (int64_t j = 0; j < W; ++j) lane[j] = static_cast<int32_t>(j);
          vec::iv i0 = lane, i1 = lane + static_cast<int32_t>(W), at0 = i0, at1 = i1, nans{};
          for (; v + 2 * W <= V; v += 2 * W) {
            const vec::fv x0 = vec::load(row + v), x1 = vec::load(row + v + W);
            const vec::iv g0 = x0 > m0, g1 = x1 > m1;
            m0 = g0 ? x0 : m0;
            m1 = g1 ? x1 : m1;
            at0 = g0 ? i0 : at0;
            at1 = g1 ? i1 : at1;
            nans |= (x0 != x0) | (x1 != x1);
            i0 += static_cast<int32_t>(2 * W);
            i1 += static_cast<int32_t>(2 * W);
          }
          for (int64_t j = 0; j < W; ++j) {
            nan |= nans[j] != 0;
            for (const auto& [m, a] : {std::pair<float, int64_t>{m0[j], at0[j]}, std::pair<float, int64_t>{m1[j], at1[j]}})
              if (m > mx || (m == mx && a < at)) mx = m, at = a;
          }
        }
        for (; v < V; ++v) {
          const float x = Val<scalar_t>::ld(row[v]);
          nan |= x != x;
          if (x > mx) mx = x, at = v;
        }
        if (nan) {
          for (v = 0; v < V; ++v) {
            const float x = Val<scalar_t>::ld(row[v]);
            if (x != x) {
              at = v;
              break;
            }
          }
        }
        tp[i] = at;
        cp[i] = Val<scalar_t>::ld(row[at]);
      }
    });
  });
  return {tokens, chosen};
}

// The step's new K and V rows into their cache slots: k/v [N, KVH, D] (rows strided, e.g. views
// of the qkv projection; each row's heads contiguous), caches [slots, KVH, D] of their dtype.
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k, v: [N, KVH, D], each row's heads contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 3 && k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2),
              "caches: contiguous [slots, KVH, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k, v and the caches of one dtype");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() && slots.size(0) == k.size(0), "slots: int64 [N]");
  const int64_t N = k.size(0), row = k.size(1) * k.size(2), num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "a slot outside the cache");
  const int64_t bytes = row * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 2 * bytes)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(kc + sp[i] * bytes, kp + i * ks, bytes);
      std::memcpy(vc + sp[i] * bytes, vp + i * vs, bytes);
    }
  });
}

void register_layer_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (Llama's, or Gemma's with offset)", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then Llama's RMSNorm of it", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("act_and_mul", &act_and_mul, "silu (0) or gelu-tanh (1) of the gate times up", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary_", &rotary_, "RoPE in place, rotate-half layout", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("store_kv", &store_kv, "the new K/V rows into their cache slots", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "greedy token and its logit per row (numpy's argmax rule)", pybind11::call_guard<pybind11::gil_scoped_release>());
}
