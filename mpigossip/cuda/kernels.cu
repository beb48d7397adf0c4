// mpigossip fused kernels: every element is read and written once per call.
// Compiled at run time by CuPy (RawModule, NVRTC) and checked with nvcc by the tests.
// Half precision accumulates in float; float and double accumulate in their own type.
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

#define GRID_STRIDE(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

// out = self_w * x + sum_j weights[j] * recvs[j];  if debias: z = out / w.
// out may alias x. recvs is a device array of k device pointers.
template <typename T>
__global__ void weighted_sum(T* out, const T* x, const double self_w,
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
template <typename T>
__global__ void split_share(T* x, T* send, const double p, const long long n) {
    typedef typename Acc<T>::type A;
    GRID_STRIDE(i, n) {
        const T v = store<T>(static_cast<A>(p) * load<T>(x[i]));
        x[i] = v;
        send[i] = v;
    }
}

// De-bias: z = x / w.
template <typename T>
__global__ void debias(T* z, const T* x, const double w, const long long n) {
    typedef typename Acc<T>::type A;
    GRID_STRIDE(i, n) { z[i] = store<T>(load<T>(x[i]) / static_cast<A>(w)); }
}

// Elastic step: u = beta * (x - c); c = u; x = x - u.
template <typename T>
__global__ void elastic(T* x, T* c, const double beta, const long long n) {
    typedef typename Acc<T>::type A;
    GRID_STRIDE(i, n) {
        const A xi = load<T>(x[i]);
        const T u = store<T>(static_cast<A>(beta) * (xi - load<T>(c[i])));
        c[i] = u;
        x[i] = store<T>(xi - load<T>(u));
    }
}

// x = alpha * x.
template <typename T>
__global__ void scale(T* x, const double alpha, const long long n) {
    typedef typename Acc<T>::type A;
    GRID_STRIDE(i, n) { x[i] = store<T>(static_cast<A>(alpha) * load<T>(x[i])); }
}
