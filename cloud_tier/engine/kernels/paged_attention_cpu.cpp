// Decode-time paged attention on CPU: one query token per sequence, K/V read in place from the
// block-paged cache (no gather, no padding), online softmax, grouped-query heads sharing one
// pass over their K/V. Parallel over (sequence, kv head). An int8 cache is read as stored, each row
// scaled by its float32 scale (per slot and kv head) as it is loaded: a quarter of float32's bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode(const float* q, const scalar_t* kc, const scalar_t* vc, const float* ks, const float* vs,
            const int64_t* tables, const int64_t* lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_blocks,
            float scale, int64_t window) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), s(G * bs), kf(bs * D), vf(bs * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH;
      const int64_t L = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const float* qb = q + (b * H + kh * G) * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t blk = start / bs; blk * bs < L; ++blk) {
        const int64_t block_id = tables[b * max_blocks + blk];
        const int64_t p0 = std::max(start, blk * bs), p1 = std::min(L, (blk + 1) * bs);
        const int64_t n = p1 - p0, first = p0 - blk * bs;
        for (int64_t i = 0; i < n; ++i) {  // this block's K/V rows of head kh, as float
          const int64_t row = (block_id * bs + first + i) * KVH + kh;
          const scalar_t* kp = kc + row * D;
          const scalar_t* vp = vc + row * D;
          const float k_scale = ks ? ks[row] : 1.f, v_scale = vs ? vs[row] : 1.f;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) {
            kf[i * D + d] = static_cast<float>(kp[d]) * k_scale;
            vf[i * D + d] = static_cast<float>(vp[d]) * v_scale;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t i = 0; i < n; ++i) {
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kf[i * D + d];
            s[g * bs + i] = dot * scale;
            block_max = std::max(block_max, s[g * bs + i]);
          }
          const float new_m = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - new_m);
          float* a = acc.data() + g * D;
          l[g] *= correction;
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          for (int64_t i = 0; i < n; ++i) {
            const float p = std::exp(s[g * bs + i] - new_m);
            l[g] += p;
            const float* vr = vf.data() + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
          }
          m[g] = new_m;
        }
      }
      float* ob = out + (b * H + kh * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g * D + d] / l[g];
    }
  });
}

}  // namespace

// q [B, H, D] float32; caches [slots, KVH, D] (slots = blocks * bs); tables [B, max_blocks] int64;
// lens [B] int64 (tokens in the cache, the new one included). Returns [B, H, D] float32.
namespace {

void check_args(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& tables, const torch::Tensor& lens) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "q: contiguous float32 [B, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3, "caches: contiguous [slots, KVH, D]");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && tables.is_contiguous() && lens.dtype() == torch::kInt64, "int64 tables/lens");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2), "head shapes");
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale, int64_t window, int64_t block_size) {
  check_args(q, k_cache, v_cache, tables, lens);
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), nullptr, nullptr,
                     tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0), q.size(1),
                     k_cache.size(1), q.size(2), block_size, tables.size(1), static_cast<float>(scale), window);
  });
  return out;
}

// The same over an int8 cache: caches [slots, KVH, D] int8, scales [slots, KVH] float32.
torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor k_scale, torch::Tensor v_cache,
                                torch::Tensor v_scale, torch::Tensor tables, torch::Tensor lens, double scale,
                                int64_t window, int64_t block_size) {
  check_args(q, k_cache, v_cache, tables, lens);
  TORCH_CHECK(k_cache.dtype() == torch::kInt8 && v_cache.dtype() == torch::kInt8, "int8 caches");
  TORCH_CHECK(k_scale.dtype() == torch::kFloat32 && v_scale.dtype() == torch::kFloat32 && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && k_scale.numel() == k_cache.size(0) * k_cache.size(1) &&
                  v_scale.numel() == k_scale.numel(),
              "scales: contiguous float32 [slots, KVH]");
  auto out = torch::empty_like(q);
  decode<int8_t>(q.data_ptr<float>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                 k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), tables.data_ptr<int64_t>(),
                 lens.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0), q.size(1), k_cache.size(1), q.size(2),
                 block_size, tables.size(1), static_cast<float>(scale), window);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode-time paged attention reading K/V blocks in place");
  m.def("paged_decode_int8", &paged_decode_int8, "the same over an int8 cache with per-row float32 scales");
}
