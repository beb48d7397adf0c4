// mpigossip fused kernels: every element is read and written once per call.
// Compiled at run time by CuPy (RawModule, NVRTC) and checked with nvcc by the tests.
// Half precision accumulates in float; float and double accumulate in their own type.
//
// Memory bandwidth: each thread moves V elements per access (V = 16 bytes / sizeof(T) when
// every operand is 16-byte aligned, else 1), so loads and stores are 128-bit; the last
// n % V elements are done one by one. weighted_sum takes its K received buffers (K <= 8,
// a compile-time constant) as kernel arguments, so no device array of pointers is built
// per call; weighted_sum_many (any K) reads them from a device array.
#include <cuda_fp16.h>

template <typename T> struct Acc { typedef T type; };
template <> struct Acc<__half> { typedef float type; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type load(const T v) {
    return static_cast<typename Acc<T>::type>(v);
}
template <> __device__ __forceinline__ float load<__half>(const __half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T store(const typename Acc<T>::type v) {
    return static_cast<T>(v);
}
template <> __device__ __forceinline__ __half store<__half>(const float v) { return __float2half(v); }

// W consecutive elements, loaded and stored as one aligned access.
template <typename T, int W> struct alignas(sizeof(T) * W) Pack { T v[W]; };

#define GRID_STRIDE(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

// Every element once: the first n / V * V in packs of V, the last n % V one by one.
template <int V, typename F> __device__ __forceinline__ void for_each(const F& f, const long long n) {
    const long long packs = n / V;
    GRID_STRIDE(i, packs) { f.template apply<V>(i); }
    if (V > 1) {
        const long long t = packs * V + blockIdx.x * (long long)blockDim.x + threadIdx.x;
        if (t < n) f.template apply<1>(t);
    }
}

template <typename T, int W> __device__ __forceinline__ Pack<T, W> get(const T* p, const long long i) {
    return reinterpret_cast<const Pack<T, W>*>(p)[i];
}
template <typename T, int W> __device__ __forceinline__ void put(T* p, const long long i, const Pack<T, W>& v) {
    reinterpret_cast<Pack<T, W>*>(p)[i] = v;
}

// out = self_w * x + sum_{j<K} wt[j] * r[j];  if debias: z = out / w.  out may alias x.
template <typename T, int K> struct WeightedSum {
    typedef typename Acc<T>::type A;
    T* out; const T* x; const T* r[8]; A sw; A wt[8]; T* z; int debias; A w;
    template <int W> __device__ __forceinline__ void apply(const long long i) const {
        const Pack<T, W> xv = get<T, W>(x, i);
        A acc[W];
#pragma unroll
        for (int e = 0; e < W; ++e) acc[e] = sw * load<T>(xv.v[e]);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const Pack<T, W> rv = get<T, W>(r[j], i);
#pragma unroll
            for (int e = 0; e < W; ++e) acc[e] += wt[j] * load<T>(rv.v[e]);
        }
        Pack<T, W> o;
#pragma unroll
        for (int e = 0; e < W; ++e) o.v[e] = store<T>(acc[e]);
        put<T, W>(out, i, o);
        if (debias) {
#pragma unroll
            for (int e = 0; e < W; ++e) o.v[e] = store<T>(load<T>(o.v[e]) / w);
            put<T, W>(z, i, o);
        }
    }
};

template <typename T, int K, int V>
__global__ void weighted_sum(T* out, const T* x, const double self_w,
                             const T* r0, const T* r1, const T* r2, const T* r3,
                             const T* r4, const T* r5, const T* r6, const T* r7,
                             const double w0, const double w1, const double w2, const double w3,
                             const double w4, const double w5, const double w6, const double w7,
                             T* z, const int debias, const double w, const long long n) {
    typedef typename Acc<T>::type A;
    const WeightedSum<T, K> f = {out, x, {r0, r1, r2, r3, r4, r5, r6, r7}, static_cast<A>(self_w),
                                 {static_cast<A>(w0), static_cast<A>(w1), static_cast<A>(w2), static_cast<A>(w3),
                                  static_cast<A>(w4), static_cast<A>(w5), static_cast<A>(w6), static_cast<A>(w7)},
                                 z, debias, static_cast<A>(w)};
    for_each<V>(f, n);
}

// Any number of received buffers: recvs is a device array of k device pointers.
template <typename T>
__global__ void weighted_sum_many(T* out, const T* x, const double self_w,
                                  const unsigned long long* recvs, const double* weights, const int k,
                                  T* z, const int debias, const double w, const long long n) {
    typedef typename Acc<T>::type A;
    GRID_STRIDE(i, n) {
        A acc = static_cast<A>(self_w) * load<T>(x[i]);
        for (int j = 0; j < k; ++j) {
            const T* r = reinterpret_cast<const T*>(recvs[j]);
            acc += static_cast<A>(weights[j]) * load<T>(r[i]);
        }
        const T v = store<T>(acc);
        out[i] = v;
        if (debias) z[i] = store<T>(load<T>(v) / static_cast<A>(w));
    }
}

// PushSum split for overlap mode: v = p * x; x = v; send = v.
template <typename T> struct SplitShare {
    typedef typename Acc<T>::type A;
    T* x; T* send; A p;
    template <int W> __device__ __forceinline__ void apply(const long long i) const {
        Pack<T, W> v = get<T, W>(x, i);
#pragma unroll
        for (int e = 0; e < W; ++e) v.v[e] = store<T>(p * load<T>(v.v[e]));
        put<T, W>(x, i, v);
        put<T, W>(send, i, v);
    }
};

template <typename T, int V>
__global__ void split_share(T* x, T* send, const double p, const long long n) {
    const SplitShare<T> f = {x, send, static_cast<typename Acc<T>::type>(p)};
    for_each<V>(f, n);
}

// De-bias: z = x / w.
template <typename T> struct Debias {
    typedef typename Acc<T>::type A;
    T* z; const T* x; A w;
    template <int W> __device__ __forceinline__ void apply(const long long i) const {
        Pack<T, W> v = get<T, W>(x, i);
#pragma unroll
        for (int e = 0; e < W; ++e) v.v[e] = store<T>(load<T>(v.v[e]) / w);
        put<T, W>(z, i, v);
    }
};

template <typename T, int V>
__global__ void debias(T* z, const T* x, const double w, const long long n) {
    const Debias<T> f = {z, x, static_cast<typename Acc<T>::type>(w)};
    for_each<V>(f, n);
}

// Elastic step: u = alpha * (x - c); c = u; x = x - u.
template <typename T> struct Elastic {
    typedef typename Acc<T>::type A;
    T* x; T* c; A alpha;
    template <int W> __device__ __forceinline__ void apply(const long long i) const {
        Pack<T, W> xv = get<T, W>(x, i);
        Pack<T, W> cv = get<T, W>(c, i);
#pragma unroll
        for (int e = 0; e < W; ++e) {
            const A xi = load<T>(xv.v[e]);
            const T u = store<T>(alpha * (xi - load<T>(cv.v[e])));
            cv.v[e] = u;
            xv.v[e] = store<T>(xi - load<T>(u));
        }
        put<T, W>(c, i, cv);
        put<T, W>(x, i, xv);
    }
};

template <typename T, int V>
__global__ void elastic(T* x, T* c, const double alpha, const long long n) {
    const Elastic<T> f = {x, c, static_cast<typename Acc<T>::type>(alpha)};
    for_each<V>(f, n);
}

// x = alpha * x.
template <typename T> struct Scale {
    typedef typename Acc<T>::type A;
    T* x; A alpha;
    template <int W> __device__ __forceinline__ void apply(const long long i) const {
        Pack<T, W> v = get<T, W>(x, i);
#pragma unroll
        for (int e = 0; e < W; ++e) v.v[e] = store<T>(alpha * load<T>(v.v[e]));
        put<T, W>(x, i, v);
    }
};

template <typename T, int V>
__global__ void scale(T* x, const double alpha, const long long n) {
    const Scale<T> f = {x, static_cast<typename Acc<T>::type>(alpha)};
    for_each<V>(f, n);
}

// Outer optimizer step (local SGD, SlowMo, DiLoCo) on the model z = x / w just averaged:
// g = a - x / w; m = mu * m + g; d = nesterov ? g + mu * m : m; a -= lr * d; x = w * a.
template <typename T> struct Outer {
    typedef typename Acc<T>::type A;
    T* a; T* x; T* m; A lr; A mu; A w; int nesterov;
    template <int W> __device__ __forceinline__ void apply(const long long i) const {
        Pack<T, W> av = get<T, W>(a, i);
        Pack<T, W> xv = get<T, W>(x, i);
        Pack<T, W> mv = get<T, W>(m, i);
#pragma unroll
        for (int e = 0; e < W; ++e) {
            const A ai = load<T>(av.v[e]);
            const A g = ai - load<T>(xv.v[e]) / w;
            const A mi = mu * load<T>(mv.v[e]) + g;
            const A an = ai - lr * (nesterov ? g + mu * mi : mi);
            mv.v[e] = store<T>(mi);
            av.v[e] = store<T>(an);
            xv.v[e] = store<T>(w * an);
        }
        put<T, W>(m, i, mv);
        put<T, W>(a, i, av);
        put<T, W>(x, i, xv);
    }
};

template <typename T, int V>
__global__ void outer(T* a, T* x, T* m, const double lr, const double mu, const double w, const int nesterov,
                      const long long n) {
    typedef typename Acc<T>::type A;
    const Outer<T> f = {a, x, m, static_cast<A>(lr), static_cast<A>(mu), static_cast<A>(w), nesterov};
    for_each<V>(f, n);
}

// ---------------------------------------------------------------------------- wire formats
// How a buffer travels compressed (mpigossip/core/wire.py): F = 0 bf16 (the top 16 bits of a
// float, rounded to nearest even), 1 fp16 (finite values saturated at +-65504), 2 int8 with one float
// scale per QBLOCK elements. One chunk of n elements on the wire: bf16/fp16: n 16-bit
// words; int8: ceil(n / QBLOCK) float scales, then n int8 values. Encoding may keep the
// rounding error of the share that leaves: x -= share * decode(wire) in the same pass (PushSum's exact mass). The
// encoded value is scale * x (AllReduce's pre-scaling; share is 0 then).
#define QBLOCK 512
#define QNONFINITE (-128)                  // mpigossip.core.wire.INT8_NONFINITE
#define QTINY 3.7615824e-37f               // mpigossip.core.wire._INT8_TINY: 128 / FLT_MAX

__device__ __forceinline__ float bf16_decode(const unsigned short b) {
    return __uint_as_float(static_cast<unsigned int>(b) << 16);
}
// To nearest even, or (stochastic) up with the probability of the distance to the lower value:
// 16 random low bits added before truncating.
__device__ __forceinline__ unsigned short bf16_encode(const float f, const int stochastic, const unsigned int bits) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN (and inf inf: no carry out)
    u += stochastic ? bits : 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
}
// The 16 random bits of element i under a step's key (mpigossip.core.wire.random_bits, bit for bit):
// the top half of murmur3's 32-bit finaliser of i * 0x9E3779B1 + key (mod 2^32).
__device__ __forceinline__ unsigned int random_bits(const unsigned int key, const long long i) {
    unsigned int h = static_cast<unsigned int>(i) * 0x9E3779B1u + key;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h >> 16;
}
// (bits + 1/2) / 2^16: a uniform float in (0, 1), exact (mpigossip.core.wire._uniform).
__device__ __forceinline__ float uniform(const unsigned int bits) {
    return (static_cast<float>(bits) + 0.5f) * 1.52587890625e-05f;
}
// fp16, stochastically (mpigossip.core.wire._fp16_stochastic, the same float32 operations, unfused):
// floor(c / ulp + u) * ulp with ulp float16's spacing at c (a power of two, at least 2^-24);
// every operation exact but the addition of u. c finite and saturated; the result converts to
// float16 exactly.
__device__ __forceinline__ float fp16_stochastic(const float c, const unsigned int bits) {
    unsigned int e = (__float_as_uint(c) >> 23) & 0xffu;
    e = e < 113u ? 113u : e;
    const float inv = __uint_as_float((264u - e) << 23), ulp = __uint_as_float((e - 10u) << 23);
    return __fmul_rn(floorf(__fadd_rn(__fmul_rn(c, inv), uniform(bits))), ulp);
}
__device__ __forceinline__ float fp16_saturate(const float f) {
    return (f != f || isinf(f)) ? f : fminf(fmaxf(f, -65504.0f), 65504.0f);  // NaN and inf stay
}

template <int F> __device__ __forceinline__ float wire_value(const unsigned char* wire, const long long i,
                                                             const long long n);
template <> __device__ __forceinline__ float wire_value<0>(const unsigned char* wire, const long long i,
                                                           const long long) {
    return bf16_decode(reinterpret_cast<const unsigned short*>(wire)[i]);
}
template <> __device__ __forceinline__ float wire_value<1>(const unsigned char* wire, const long long i,
                                                           const long long) {
    return __half2float(reinterpret_cast<const __half*>(wire)[i]);
}
template <> __device__ __forceinline__ float wire_value<2>(const unsigned char* wire, const long long i,
                                                           const long long n) {
    const long long blocks = (n + QBLOCK - 1) / QBLOCK;
    const signed char q = reinterpret_cast<const signed char*>(wire + 4 * blocks)[i];
    if (q == QNONFINITE) return __int_as_float(0x7fc00000);  // a NaN or inf was sent: NaN
    return static_cast<float>(q) * reinterpret_cast<const float*>(wire)[i / QBLOCK];
}

// bf16 / fp16: wire = encode(scale * x); if share != 0: x -= share * decode(wire) (bf16 then
// rounds stochastically, see mpigossip/core/wire.py).
template <typename T, int F>
__global__ void encode16(T* x, unsigned char* wire, const double share, const double scale,
                         const unsigned int key, const long long offset, const long long n) {
    typedef typename Acc<T>::type A;
    GRID_STRIDE(i, n) {
        const A v = load<T>(x[i]) * static_cast<A>(scale);
        float d;
        if (F == 0) {
            const unsigned short b = bf16_encode(static_cast<float>(v), share != 0.0,
                                                 share != 0.0 ? random_bits(key, offset + i) : 0u);
            reinterpret_cast<unsigned short*>(wire)[i] = b;
            d = bf16_decode(b);
        } else {
            float c = fp16_saturate(static_cast<float>(v));
            if (share != 0.0 && isfinite(c)) c = fp16_stochastic(c, random_bits(key, offset + i));
            const __half h = __float2half_rn(c);
            reinterpret_cast<__half*>(wire)[i] = h;
            d = __half2float(h);
        }
        // the sender keeps what it did not send; a NaN or inf stays as it is (not inf - inf)
        if (share != 0.0 && isfinite(static_cast<double>(v))) x[i] = store<T>(v - static_cast<A>(share) * static_cast<A>(d));
    }
}

// int8: one thread block of 256 threads per QBLOCK elements (grid-stride over the blocks):
// m = max(max |x| over the block's finite values, QTINY), scale = m / 127, q = rint(x / scale);
// a NaN or inf is sent as QNONFINITE and left out of m (the rest of the block is unharmed).
// Where the error is kept (share != 0) q = floor(x / scale + u), u uniform from random_bits(key,
// offset + i), unfused as the CPU computes it; else to nearest.
template <typename T>
__global__ void encode_int8(T* x, unsigned char* wire, const double share, const double scale,
                            const unsigned int key, const long long offset, const long long n) {
    typedef typename Acc<T>::type A;
    __shared__ float warp_max[8];
    const long long blocks = (n + QBLOCK - 1) / QBLOCK;
    float* scales = reinterpret_cast<float*>(wire);
    signed char* q = reinterpret_cast<signed char*>(wire + 4 * blocks);
    for (long long b = blockIdx.x; b < blocks; b += gridDim.x) {
        const long long i0 = b * QBLOCK + threadIdx.x, i1 = i0 + 256;
        const float s = static_cast<float>(scale);
        const float v0 = i0 < n ? s * static_cast<float>(load<T>(x[i0])) : 0.0f;
        const float v1 = i1 < n ? s * static_cast<float>(load<T>(x[i1])) : 0.0f;
        const bool ok0 = isfinite(v0), ok1 = isfinite(v1);
        float m = fmaxf(ok0 ? fabsf(v0) : 0.0f, ok1 ? fabsf(v1) : 0.0f);
        for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
        if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
        __syncthreads();
        m = warp_max[0];
        for (int w = 1; w < 8; ++w) m = fmaxf(m, warp_max[w]);
        m = fmaxf(m, QTINY);  // 127 / m stays finite for a block of tiny (or zero) values
        const float q_scale = m / 127.0f, inv = 127.0f / m;
        if (threadIdx.x == 0) scales[b] = q_scale;
        if (i0 < n) {
            const float t = __fmul_rn(v0, inv);
            const float r = fminf(fmaxf(share != 0.0 ? floorf(__fadd_rn(t, uniform(random_bits(key, offset + i0))))
                                                     : rintf(t), -127.0f), 127.0f);
            q[i0] = ok0 ? static_cast<signed char>(r) : static_cast<signed char>(QNONFINITE);
            if (share != 0.0 && ok0) x[i0] = store<T>(load<T>(x[i0]) - static_cast<A>(share) * static_cast<A>(r * q_scale));
        }
        if (i1 < n) {
            const float t = __fmul_rn(v1, inv);
            const float r = fminf(fmaxf(share != 0.0 ? floorf(__fadd_rn(t, uniform(random_bits(key, offset + i1))))
                                                     : rintf(t), -127.0f), 127.0f);
            q[i1] = ok1 ? static_cast<signed char>(r) : static_cast<signed char>(QNONFINITE);
            if (share != 0.0 && ok1) x[i1] = store<T>(load<T>(x[i1]) - static_cast<A>(share) * static_cast<A>(r * q_scale));
        }
        __syncthreads();  // warp_max is rewritten for the next block
    }
}

// out = self_w * x + sum_{j<K} wt[j] * decode(wire[j]);  if debias: z = out / w.  out may alias x.
template <typename T, int F, int K>
__global__ void decode_sum(T* out, const T* x, const double self_w,
                           const unsigned char* r0, const unsigned char* r1, const unsigned char* r2,
                           const unsigned char* r3, const unsigned char* r4, const unsigned char* r5,
                           const unsigned char* r6, const unsigned char* r7,
                           const double w0, const double w1, const double w2, const double w3,
                           const double w4, const double w5, const double w6, const double w7,
                           T* z, const int debias, const double w, const long long n) {
    typedef typename Acc<T>::type A;
    const unsigned char* r[8] = {r0, r1, r2, r3, r4, r5, r6, r7};
    const A wt[8] = {static_cast<A>(w0), static_cast<A>(w1), static_cast<A>(w2), static_cast<A>(w3),
                     static_cast<A>(w4), static_cast<A>(w5), static_cast<A>(w6), static_cast<A>(w7)};
    GRID_STRIDE(i, n) {
        A acc = self_w != 0.0 ? static_cast<A>(self_w) * load<T>(x[i]) : static_cast<A>(0);  // x may be garbage
#pragma unroll
        for (int j = 0; j < K; ++j) acc += wt[j] * static_cast<A>(wire_value<F>(r[j], i, n));
        const T v = store<T>(acc);
        out[i] = v;
        if (debias) z[i] = store<T>(load<T>(v) / static_cast<A>(w));
    }
}
