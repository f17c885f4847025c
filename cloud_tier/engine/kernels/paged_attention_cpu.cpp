// Decode-time paged attention on CPU: one query token per sequence, K/V read in place from the
// block-paged cache (no gather, no padding), grouped-query heads sharing one pass over their K/V.
// On a CPU with AVX512_BF16 a bfloat16 cache with bfloat16 queries (head dim 64 or 128) takes its
// own path (decode_bf16_avx512); everything else the generic one below.
// Parallel over sequences (over (sequence, kv head) when there are fewer sequences than twice the
// threads), handed out longest first, each thread fetching its next item's rows while it computes
// the current one. Per sequence, two passes: all scores (each K row converted
// to float once for the G query heads sharing it, in cache order so a block's rows stream), a
// softmax with a vectorized exp, then one pass over V. The head dim is a compile-time constant for
// 64/128/256 so a row stays in registers. An int8 cache is read as stored, each row scaled by its
// float32 scale (per slot and kv head) as it is loaded: a quarter of float32's bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_common.h"

namespace {

using cascade::exp_neg;
using cascade::Val;

// CASCADE_ENGINE_FAST_DECODE=0 keeps the generic path where a faster one exists (to compare them)
inline bool fast_decode_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CASCADE_ENGINE_FAST_DECODE");
    return !(v && (v[0] == '0' || v[0] == 'n' || v[0] == 'f'));
  }();
  return on;
}

// eight floats: GCC's generic vectors (AVX/AVX-512 registers on x86-64, two SSE halves at worst)
typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// pairwise sums of a and b, interleaved as AVX's hadd: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, ...]
inline v8 hadd(v8 a, v8 b) {
  return __builtin_shuffle(a, b, v8i{0, 2, 8, 10, 4, 6, 12, 14}) + __builtin_shuffle(a, b, v8i{1, 3, 9, 11, 5, 7, 13, 15});
}

// r[j] = the sum of a[j]'s lanes: eight dot products finished with seven vector adds, not eight
// horizontal reductions
inline v8 sum8(const v8* a) {
  const v8 lo = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
  const v8 hi = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shuffle(lo, hi, v8i{0, 1, 2, 3, 8, 9, 10, 11}) + __builtin_shuffle(lo, hi, v8i{4, 5, 6, 7, 12, 13, 14, 15});
}

// the largest of x[0..n) (-inf for none), eight lanes at a time (a scalar max chain waits on
// each compare; GCC vectorizes no float max reduction without -ffinite-math-only)
inline float max_of(const float* x, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  v8 m = {neg_inf, neg_inf, neg_inf, neg_inf, neg_inf, neg_inf, neg_inf, neg_inf};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 v = load8(x + i);
    m = v > m ? v : m;
  }
  float mx = neg_inf;
  for (int64_t j = 0; j < 8; ++j) mx = std::max(mx, m[j]);
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// sl[i] = the cache slot of token start + i, for tokens [start, L) of a sequence with block table
// ``table``: walked block by block (no division per token)
inline void cache_slots(const int64_t* table, int64_t start, int64_t L, int64_t bs, int64_t* sl) {
  for (int64_t p = start, blk = start / bs, off = start % bs; p < L; ++p) {
    sl[p - start] = table[blk] * bs + off;
    if (++off == bs) off = 0, ++blk;
  }
}

// x[0..n) replaced by its softmax (max subtracted, vectorized exp)
inline void softmax_in_place(float* x, int64_t n) {
  const float mx = max_of(x, n);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = exp_neg(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Work items handed to the threads longest first, each thread taking the next one when it is done:
// at::parallel_for's even split of the index range gives one thread whichever long sequences
// happen to sit in its half, and the other waits for it. The same items, so the same results.
class LongestFirst {
 public:
  template <typename Cost> LongestFirst(int64_t n, Cost cost) : order_(n) {
    std::iota(order_.begin(), order_.end(), int64_t{0});
    std::vector<int64_t> c(n);
    for (int64_t i = 0; i < n; ++i) c[i] = cost(i);
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return c[a] > c[b]; });
  }
  int64_t threads() const { return std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(order_.size())); }
  int64_t take() {  // the next item to compute, -1 when none is left
    const int64_t i = at_.fetch_add(1, std::memory_order_relaxed);
    return i < static_cast<int64_t>(order_.size()) ? order_[i] : -1;
  }

 private:
  std::vector<int64_t> order_;
  std::atomic<int64_t> at_{0};
};

// the tokens sequence b reads (its last ones): its length, or the window's when that is shorter
inline int64_t attended(const int64_t* lens, int64_t b, int64_t window) {
  return window > 0 ? std::min(lens[b], window) : lens[b];
}

// A thread's next work item's K and V rows, fetched into L2 a share at a time while it computes
// the current one (each thread takes its items one ahead). The hardware prefetcher follows the
// rows of a block but not the jump to another sequence's scattered blocks, and rows first read on
// demand from DRAM leave the core waiting: a probe of this access pattern (200 sequences of ~141
// tokens, 30 layers' caches, an AMD EPYC's two cores) read 16 GB/s on demand and 19.5 GB/s fetched
// this way; the kernel at that shape went from 3.0-3.6 to 1.8-2.2 ms a layer in bfloat16 and from
// 5.1-5.7 to 2.8-3.4 ms in float32 (same outputs: prefetches change no value). Into L2, not L1:
// fetched into L1 a whole sequence's rows evict the current one's.
class Ahead {
 public:
  // the work items of a kernel call: item i is kv heads [(i % split) * per, + per) of sequence i / split
  Ahead(const void* kc, const void* vc, int64_t KVH, int64_t row_bytes, const int64_t* tables, int64_t max_blocks,
        const int64_t* lens, int64_t window, int64_t bs, int64_t split, int64_t per, int64_t max_len)
      : k_(static_cast<const char*>(kc)), v_(static_cast<const char*>(vc)), slot_bytes_(KVH * row_bytes),
        row_bytes_(row_bytes), tables_(tables), lens_(lens), max_blocks_(max_blocks), window_(window), bs_(bs),
        split_(split), per_(per), slots_(max_len) {}
  // fetch ``item``'s K and V rows spread over ``steps`` calls of step(); item -1: nothing to fetch
  void aim(int64_t item, int64_t steps) {
    pass_ = 2, t_ = 0, line_ = 0;
    if (item < 0) return;
    const int64_t b = item / split_, L = lens_[b];
    n_ = attended(lens_, b, window_);
    if (n_ <= 0) return;
    cache_slots(tables_ + b * max_blocks_, L - n_, L, bs_, slots_.data());
    off_ = (item % split_) * per_ * row_bytes_, lines_ = (per_ * row_bytes_ + 63) / 64, pass_ = 0;
    quota_ = (2 * n_ * lines_ + steps - 1) / std::max<int64_t>(steps, 1);
  }
  void step() {
    for (int64_t i = 0; i < quota_ && pass_ < 2; ++i) {
      __builtin_prefetch((pass_ ? v_ : k_) + slots_[t_] * slot_bytes_ + off_ + line_ * 64, 0, 2);  // 2: into L2
      if (++line_ == lines_) {
        line_ = 0;
        if (++t_ == n_) t_ = 0, ++pass_;
      }
    }
  }

 private:
  const char *k_, *v_;
  int64_t slot_bytes_, row_bytes_;
  const int64_t *tables_, *lens_;
  int64_t max_blocks_;
  int64_t window_, bs_, split_, per_;
  std::vector<int64_t> slots_;
  int64_t n_ = 0, off_ = 0, lines_ = 0, quota_ = 0, pass_ = 2, t_ = 0, line_ = 0;
};

// Two passes per sequence (or per kv head, when there are too few sequences to keep every
// thread busy): every score of its heads, one pass over K in cache order (a block's rows of all kv
// heads are contiguous, so it streams), each K row converted once for the G query heads sharing
// it; the softmax (vectorized exp); then one pass over V the same way.
template <typename scalar_t, typename QT, int64_t FIXED_D>
void decode_d(const void* q_, int64_t q_stride, const void* kc_, const void* vc_, const float* ks, const float* vs,
              const int64_t* tables, const int64_t* lens, void* out_, int64_t B, int64_t H, int64_t KVH,
              int64_t D_, int64_t bs, int64_t max_blocks, float scale, int64_t window) {
  const int64_t D = FIXED_D ? FIXED_D : D_;  // a constant lets the compiler keep a row in registers
  using raw = typename Val<scalar_t>::raw;
  const raw* kc = static_cast<const raw*>(kc_);
  const raw* vc = static_cast<const raw*>(vc_);
  using qraw = typename Val<QT>::raw;
  const qraw* q = static_cast<const qraw*>(q_);
  qraw* out = static_cast<qraw*>(out_);
  const int64_t G = H / KVH;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lens[b]);
  const int64_t split = B >= 2 * at::get_num_threads() ? 1 : KVH;  // kv-head groups per sequence
  const int64_t per = KVH / split;
  LongestFirst work(B * split, [&](int64_t i) { return attended(lens, i / split, window); });
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s(per * G * max_len), qs(per * G * D), row(D), acc(per * G * D), kbuf(8 * D);
    std::vector<int64_t> slots(max_len);
    Ahead ahead(kc, vc, KVH, D * sizeof(raw), tables, max_blocks, lens, window, bs, split, per, max_len);
    for (int64_t idx, after = work.take(); (idx = after) >= 0;) {
      const int64_t b = idx / split, k0 = (idx % split) * per;
      const int64_t L = lens[b], n = attended(lens, b, window), start = L - n;
      const int64_t groups = (n + 7) / 8;  // the passes' steps: groups of 8 tokens, or single tokens
      after = work.take();
      ahead.aim(after, (D % 8 == 0 ? groups : n) + (FIXED_D > 0 ? groups : n));
      const qraw* qb = q + b * q_stride + k0 * G * D;
      for (int64_t i = 0; i < per * G * D; ++i) qs[i] = Val<QT>::ld(qb[i]) * scale;
      const int64_t* table = tables + b * max_blocks;
      float* rw = row.data();
      int64_t* sl = slots.data();
      cache_slots(table, start, L, bs, sl);
      int64_t p = start;
      if (D % 8 == 0) {  // eight tokens at a time: their K rows as float32, then 8 dot products per head at once
        for (; p < L; p += 8) {
          const int64_t m = std::min<int64_t>(8, L - p);
          ahead.step();
          for (int64_t kh = 0; kh < per; ++kh) {
            for (int64_t j = 0; j < 8; ++j) {
              float* kr = kbuf.data() + j * D;
              if (j >= m) {
                std::fill(kr, kr + D, 0.f);
                continue;
              }
              const int64_t slot = sl[p + j - start];
              const int64_t r = slot * KVH + k0 + kh;
              const raw* kp = kc + r * D;
              const float k_scale = ks ? ks[r] : 1.f;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) kr[d] = Val<scalar_t>::ld(kp[d]) * k_scale;
            }
            for (int64_t g = 0; g < G; ++g) {
              const float* qg = qs.data() + (kh * G + g) * D;
              v8 dots[8] = {};
              for (int64_t c = 0; c < D; c += 8) {
                const v8 qv = load8(qg + c);
                for (int64_t j = 0; j < 8; ++j) dots[j] += qv * load8(kbuf.data() + j * D + c);
              }
              const v8 sums = sum8(dots);
              float* sg = s.data() + (kh * G + g) * n + (p - start);
              for (int64_t j = 0; j < m; ++j) sg[j] = sums[j];
            }
          }
        }
      }
      for (; p < L; ++p) {  // a head dim that is not a multiple of 8: one token at a time
        const int64_t slot = sl[p - start];
        ahead.step();
        for (int64_t kh = 0; kh < per; ++kh) {
          const int64_t r = slot * KVH + k0 + kh;
          const raw* kp = kc + r * D;
          const float k_scale = ks ? ks[r] : 1.f;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) rw[d] = Val<scalar_t>::ld(kp[d]) * k_scale;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qs.data() + (kh * G + g) * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * rw[d];
            s[(kh * G + g) * n + (p - start)] = dot;
          }
        }
      }
      for (int64_t h = 0; h < per * G; ++h) softmax_in_place(s.data() + h * n, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      p = start;
      if constexpr (FIXED_D > 0) {  // eight tokens at a time: their V rows as float32, each head's output in registers
        constexpr int64_t C = FIXED_D / 8;
        for (; p < L; p += 8) {
          const int64_t m = std::min<int64_t>(8, L - p);
          ahead.step();
          for (int64_t kh = 0; kh < per; ++kh) {
            for (int64_t j = 0; j < m; ++j) {
              const int64_t r = sl[p + j - start] * KVH + k0 + kh;
              const raw* vp = vc + r * D;
              const float v_scale = vs ? vs[r] : 1.f;
              float* vr = kbuf.data() + j * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) vr[d] = Val<scalar_t>::ld(vp[d]) * v_scale;
            }
            for (int64_t g = 0; g < G; ++g) {
              const float* w = s.data() + (kh * G + g) * n + (p - start);
              float* a = acc.data() + (kh * G + g) * D;
              v8 o[C];
              for (int64_t c = 0; c < C; ++c) o[c] = load8(a + 8 * c);
              for (int64_t j = 0; j < m; ++j) {
                const float wj = w[j];
                for (int64_t c = 0; c < C; ++c) o[c] += wj * load8(kbuf.data() + j * D + 8 * c);
              }
              std::memcpy(a, o, sizeof o);
            }
          }
        }
      }
      for (; p < L; ++p) {
        const int64_t slot = sl[p - start];
        ahead.step();
        for (int64_t kh = 0; kh < per; ++kh) {
          const int64_t r = slot * KVH + k0 + kh;
          const raw* vp = vc + r * D;
          const float v_scale = vs ? vs[r] : 1.f;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) rw[d] = Val<scalar_t>::ld(vp[d]) * v_scale;
          for (int64_t g = 0; g < G; ++g) {
            const float w = s[(kh * G + g) * n + (p - start)];
            float* a = acc.data() + (kh * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * rw[d];
          }
        }
      }
      qraw* ob = out + (b * H + k0 * G) * D;
      for (int64_t i = 0; i < per * G * D; ++i) ob[i] = Val<QT>::st(acc[i]);
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CASCADE_DECODE_BF16_AVX512 1

// r[j] = the sum of v[j]'s sixteen lanes: a transpose-and-add in 45 shuffles and adds, not sixteen
// horizontal reductions
inline __m512 sum16(const __m512* v) {
  __m512 x[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: four tokens' sums of that lane's four floats
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // across 128-bit lanes: pairs of lanes added
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0x88), _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// sixteen bfloat16 as float32 (their bits shifted into the high half)
inline __m512 bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The bfloat16 cache with bfloat16 queries on a CPU with AVX512_BF16: the same two passes, sixteen
// tokens at a time. Scores by VDPBF16PS straight from the cache's bits (each product exact, summed in
// float32; the scale applied to the score, not rounded into q), sixteen tokens' dot products reduced
// at once; V rows widened to float32 once per tile, each head's output accumulated in float32.
// The next tile's K rows are prefetched. At serving shapes (100 sequences of ~340 tokens on
// scattered blocks, 30 layers, GQA 9/3, D 64, 2 threads) it takes ~90 ms a step where the generic
// path takes ~115-120 ms: both wait mostly on memory (the loads of K and V from DRAM are the hot
// instructions), the generic one more, converting every K row to float32 through memory first.
template <int64_t D>
void decode_bf16_avx512(const uint16_t* q, int64_t q_stride, const uint16_t* kc, const uint16_t* vc,
                        const int64_t* tables, const int64_t* lens, uint16_t* out, int64_t B, int64_t H,
                        int64_t KVH, int64_t bs, int64_t max_blocks, float scale, int64_t window) {
  static_assert(D % 32 == 0, "whole 32-element bfloat16 pairs");
  constexpr int64_t QC = D / 32, VC = D / 16;
  // query heads per K row / V row load: their q chunks (KG * QC) or accumulators (VG * VC) stay in
  // registers beside the row
  constexpr int64_t KG = 4, VG = VC <= 4 ? 4 : VC <= 8 ? 2 : 1;
  const int64_t G = H / KVH;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lens[b]);
  const int64_t padded = (max_len + 15) / 16 * 16;
  const int64_t split = B >= 2 * at::get_num_threads() ? 1 : KVH;
  const int64_t per = KVH / split;
  LongestFirst work(B * split, [&](int64_t i) { return attended(lens, i / split, window); });
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s(per * G * padded);
    std::vector<int64_t> slots(padded);
    std::vector<__m512> acc(per * G * VC);
    Ahead ahead(kc, vc, KVH, D * 2, tables, max_blocks, lens, window, bs, split, per, max_len);
    for (int64_t idx, after = work.take(); (idx = after) >= 0;) {
      const int64_t b = idx / split, k0 = (idx % split) * per;
      const int64_t L = lens[b], n = attended(lens, b, window), start = L - n;
      after = work.take();
      ahead.aim(after, 2 * ((n + 15) / 16));  // the passes' steps: tiles of 16 tokens
      const uint16_t* qb = q + b * q_stride + k0 * G * D;
      const int64_t* table = tables + b * max_blocks;
      int64_t* sl = slots.data();
      cache_slots(table, start, L, bs, sl);
      const int64_t span = per * D * 2;  // this task's rows of one slot (bytes), contiguous
      auto prefetch = [&](const uint16_t* cache, int64_t t) {  // the rows of tokens [t, t + 16)
        for (int64_t j = t; j < std::min<int64_t>(t + 16, n); ++j) {
          const char* r = reinterpret_cast<const char*>(cache + (sl[j] * KVH + k0) * D);
          for (int64_t o = 0; o < span; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
        }
      };
      prefetch(kc, 0);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - t0);
        const __mmask16 live = static_cast<__mmask16>((1u << m) - 1u);
        prefetch(kc, t0 + 16);  // the next tile's K rows while this one's are read
        ahead.step();
        for (int64_t kh = 0; kh < per; ++kh) {
          for (int64_t g0 = 0; g0 < G; g0 += KG) {  // each K row loaded once for up to KG heads
            const int64_t gn = std::min(KG, G - g0);
            __m512bh qv[KG][QC];
            for (int64_t g = 0; g < gn; ++g)
              for (int64_t c = 0; c < QC; ++c)
                qv[g][c] = (__m512bh)_mm512_loadu_si512(qb + (kh * G + g0 + g) * D + 32 * c);
            __m512 dots[KG][16];
            for (int64_t j = 0; j < m; ++j) {
              const uint16_t* kp = kc + (sl[t0 + j] * KVH + k0 + kh) * D;
              __m512bh kv[QC];
              for (int64_t c = 0; c < QC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + 32 * c);
              for (int64_t g = 0; g < gn; ++g) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < QC; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], kv[c]);
                dots[g][j] = a;
              }
            }
            for (int64_t g = 0; g < gn; ++g) {
              for (int64_t j = m; j < 16; ++j) dots[g][j] = _mm512_setzero_ps();
              _mm512_mask_storeu_ps(s.data() + (kh * G + g0 + g) * padded + t0, live,
                                    _mm512_mul_ps(sum16(dots[g]), _mm512_set1_ps(scale)));
            }
          }
        }
      }
      for (int64_t h = 0; h < per * G; ++h) softmax_in_place(s.data() + h * padded, n);
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - t0);
        ahead.step();
        for (int64_t kh = 0; kh < per; ++kh) {
          for (int64_t g0 = 0; g0 < G; g0 += VG) {  // each V row widened once, in registers, for up to VG heads
            const int64_t gn = std::min(VG, G - g0);
            __m512 o[VG][VC];
            for (int64_t g = 0; g < gn; ++g)
              for (int64_t c = 0; c < VC; ++c) o[g][c] = acc[(kh * G + g0 + g) * VC + c];
            for (int64_t j = 0; j < m; ++j) {
              const uint16_t* vp = vc + (sl[t0 + j] * KVH + k0 + kh) * D;
              __m512 v[VC];
              for (int64_t c = 0; c < VC; ++c) v[c] = bf16x16(vp + 16 * c);
              for (int64_t g = 0; g < gn; ++g) {
                const __m512 wj = _mm512_set1_ps(s[(kh * G + g0 + g) * padded + t0 + j]);
                for (int64_t c = 0; c < VC; ++c) o[g][c] = _mm512_fmadd_ps(wj, v[c], o[g][c]);
              }
            }
            for (int64_t g = 0; g < gn; ++g)
              for (int64_t c = 0; c < VC; ++c) acc[(kh * G + g0 + g) * VC + c] = o[g][c];
          }
        }
      }
      uint16_t* ob = out + (b * H + k0 * G) * D;
      for (int64_t h = 0; h < per * G; ++h) {
        alignas(64) float row[D];
        for (int64_t c = 0; c < VC; ++c) _mm512_store_ps(row + 16 * c, acc[h * VC + c]);
        for (int64_t d = 0; d < D; ++d) ob[h * D + d] = Val<c10::BFloat16>::st(row[d]);
      }
    }
  });
}
#endif

template <typename scalar_t, typename QT>
void decode(const torch::Tensor& q, const void* kc, const void* vc, const float* ks, const float* vs,
            const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& out, int64_t KVH, int64_t bs,
            float scale, int64_t window) {
  const int64_t D = q.size(2);
#ifdef CASCADE_DECODE_BF16_AVX512
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<QT, c10::BFloat16>) {
    auto fast = [&](auto fixed) {
      decode_bf16_avx512<decltype(fixed)::value>(
          static_cast<const uint16_t*>(q.data_ptr()), q.stride(0), static_cast<const uint16_t*>(kc),
          static_cast<const uint16_t*>(vc), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
          static_cast<uint16_t*>(out.data_ptr()), q.size(0), q.size(1), KVH, bs, tables.size(1), scale, window);
    };
    if (fast_decode_enabled()) {
      if (D == 64) return fast(std::integral_constant<int64_t, 64>{});
      if (D == 128) return fast(std::integral_constant<int64_t, 128>{});
    }
  }
#endif
  auto run = [&](auto fixed) {
    decode_d<scalar_t, QT, decltype(fixed)::value>(q.data_ptr(), q.stride(0), kc, vc, ks, vs, tables.data_ptr<int64_t>(),
                                                   lens.data_ptr<int64_t>(), out.data_ptr(), q.size(0), q.size(1), KVH,
                                                   D, bs, tables.size(1), scale, window);
  };
  if (D == 64) run(std::integral_constant<int64_t, 64>{});
  else if (D == 128) run(std::integral_constant<int64_t, 128>{});
  else if (D == 256) run(std::integral_constant<int64_t, 256>{});
  else run(std::integral_constant<int64_t, 0>{});
}

// q [B, H, D]: each sequence's heads contiguous (rows may be strided, e.g. a view of the qkv
// projection); out, when given, contiguous [B, H, D] of q's dtype (the rows of the layer's output)
torch::Tensor output_for(const torch::Tensor& q, const c10::optional<torch::Tensor>& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [B, H, D], each row's heads contiguous");
  if (!out.has_value()) return torch::empty(q.sizes(), q.options());
  TORCH_CHECK(out->is_contiguous() && out->sizes() == q.sizes() && out->scalar_type() == q.scalar_type(),
              "out: contiguous, q's shape and dtype");
  return *out;
}

void check_args(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& tables, const torch::Tensor& lens) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3, "caches: contiguous [slots, KVH, D]");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && tables.is_contiguous() && lens.dtype() == torch::kInt64 && lens.is_contiguous(),
              "int64 tables/lens");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2), "head shapes");
  TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "one table and one length per sequence");
}

}  // namespace

void register_layer_ops(pybind11::module& m);  // layers_cpu.cpp
void register_int8_linear(pybind11::module& m);  // int8_linear_cpu.cpp

// q [B, H, D] (float32, or the cache's dtype); caches [slots, KVH, D] (slots = blocks * bs); tables
// [B, max_blocks] int64; lens [B] int64 (tokens in the cache, the new one included). Returns (or
// fills ``out`` with) [B, H, D] in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale, int64_t window, int64_t block_size,
                           c10::optional<torch::Tensor> out_) {
  auto out = output_for(q, out_);
  check_args(q, k_cache, v_cache, tables, lens);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || q.scalar_type() == torch::kFloat32,
              "q: float32 or the cache's dtype");
  const float sc = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 caches are not supported");
    } else if (q.scalar_type() == torch::kFloat32) {
      decode<scalar_t, float>(q, k_cache.data_ptr(), v_cache.data_ptr(), nullptr, nullptr, tables, lens, out,
                              k_cache.size(1), block_size, sc, window);
    } else {
      decode<scalar_t, scalar_t>(q, k_cache.data_ptr(), v_cache.data_ptr(), nullptr, nullptr, tables, lens, out,
                                 k_cache.size(1), block_size, sc, window);
    }
  });
  return out;
}

// The same over an int8 cache: caches [slots, KVH, D] int8, scales [slots, KVH] float32; q in
// float32, bfloat16 or float16.
torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor k_scale, torch::Tensor v_cache,
                                torch::Tensor v_scale, torch::Tensor tables, torch::Tensor lens, double scale,
                                int64_t window, int64_t block_size, c10::optional<torch::Tensor> out_) {
  auto out = output_for(q, out_);
  check_args(q, k_cache, v_cache, tables, lens);
  TORCH_CHECK(k_cache.dtype() == torch::kInt8 && v_cache.dtype() == torch::kInt8, "int8 caches");
  TORCH_CHECK(k_scale.dtype() == torch::kFloat32 && v_scale.dtype() == torch::kFloat32 && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && k_scale.numel() == k_cache.size(0) * k_cache.size(1) &&
                  v_scale.numel() == k_scale.numel(),
              "scales: contiguous float32 [slots, KVH]");
  const float sc = static_cast<float>(scale);
  const float *ks = k_scale.data_ptr<float>(), *vs = v_scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_int8", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 queries are not supported");
    } else {
      decode<int8_t, scalar_t>(q, k_cache.data_ptr(), v_cache.data_ptr(), ks, vs, tables, lens, out, k_cache.size(1),
                               block_size, sc, window);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode-time paged attention reading K/V blocks in place",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("tables"),
        pybind11::arg("lens"), pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("block_size"),
        pybind11::arg("out") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("paged_decode_int8", &paged_decode_int8, "the same over an int8 cache with per-row float32 scales",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("k_scale"), pybind11::arg("v_cache"),
        pybind11::arg("v_scale"), pybind11::arg("tables"), pybind11::arg("lens"), pybind11::arg("scale"),
        pybind11::arg("window"), pybind11::arg("block_size"), pybind11::arg("out") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
#ifdef CASCADE_DECODE_BF16_AVX512
  m.attr("has_bf16_decode_path") = true;  // decode_bf16_avx512 compiled in (this CPU has AVX512_BF16)
#else
  m.attr("has_bf16_decode_path") = false;
#endif
  register_layer_ops(m);
  register_int8_linear(m);
}
