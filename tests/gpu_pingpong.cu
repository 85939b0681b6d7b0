// Probe for the device route's design (docs/capi.md, "The device route's issue cost"): how fast
// can two processes that share one GPU (the GPU box's emulated vendors) hand a word back and
// forth through pinned host memory, when the waiting is done by
//   kernel   : one kernel per process that spins on the peer's word for every round (a
//              call's whole work in one launch: O(1) stream operations per call);
//   launches : one short kernel per round and side (write, or spin then write);
//   memops   : stream memory operations (wait value / write value), as the device route uses;
//   host     : two CPU threads (the floor);
//   kern-host: side 0's spinning kernel against side 1's CPU thread (one context on the GPU:
//              with "kernel", tells a time slice between the two contexts from the hand-over
//              itself).
// Each process is forked before CUDA is initialised; the words live in one shared mapping that
// each process registers as mapped pinned memory. Prints one line per mode: us per round trip.
// A spin that lasts more than 5 s gives up and reports it (no hang on the box).
//
// Run on the GPU box: `bash .ci/gpu-box.sh pingpong` (builds it with nvcc, writes pingpong.txt);
// by hand: nvcc -O2 -o /tmp/gpu_pingpong tests/gpu_pingpong.cu && /tmp/gpu_pingpong [rounds]
// (it calls the driver's stream memory operations through cudaGetDriverEntryPoint, so it
// links without libcuda and builds on machines without a driver).
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(2);                                                                             \
    }                                                                                      \
  } while (0)
#define CKD(x)                                                                 \
  do {                                                                         \
    CUresult r_ = (x);                                                         \
    if (r_ != CUDA_SUCCESS) {                                                  \
      fprintf(stderr, "%s:%d %s: CUresult %d\n", __FILE__, __LINE__, #x, (int)r_); \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

// The driver's stream memory operations, through the runtime's entry-point query (no -lcuda).
typedef CUresult (*MemOp32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
static MemOp32 write_value32, wait_value32;
static void load_memops() {
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPoint("cuStreamWriteValue32", (void**)&write_value32, cudaEnableDefault, &q));
  CK(cudaGetDriverEntryPoint("cuStreamWaitValue32", (void**)&wait_value32, cudaEnableDefault, &q));
  if (!write_value32 || !wait_value32) {
    fprintf(stderr, "no stream memory operations in this driver\n");
    exit(2);
  }
}

struct Shared {
  volatile unsigned int word[2][32];  // word[side][0]: the round this side reached
  volatile int ready[2];
  volatile int go;
  volatile int gave_up;
};

static double now_us() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

__device__ bool spin_until(volatile unsigned int* w, unsigned int v, volatile int* gave_up) {
  long long start = clock64();
  while (*w < v) {
    if (clock64() - start > 10000000000LL) {  // ~5 s at 2 GHz
      *gave_up = 1;
      __threadfence_system();
      return false;
    }
  }
  return true;
}

// side 0 writes first: round i: side 0 writes i, waits for side 1's i; side 1 waits for side
// 0's i, writes i.
__global__ void whole(volatile unsigned int* mine, volatile unsigned int* peer, int side, unsigned int base,
                      int rounds, volatile int* gave_up) {
  for (int i = 1; i <= rounds; ++i) {
    unsigned int v = base + i;
    if (side == 0) {
      *mine = v;
      __threadfence_system();
      if (!spin_until(peer, v, gave_up)) return;
    } else {
      if (!spin_until(peer, v, gave_up)) return;
      *mine = v;
      __threadfence_system();
    }
  }
}

__global__ void one(volatile unsigned int* mine, volatile unsigned int* peer, int side, unsigned int v,
                    volatile int* gave_up) {
  if (side == 0) {
    *mine = v;
    __threadfence_system();
    spin_until(peer, v, gave_up);
  } else {
    if (!spin_until(peer, v, gave_up)) return;
    *mine = v;
    __threadfence_system();
  }
}

static void barrier(Shared* s, int side, int phase) {
  s->ready[side] = phase;
  __sync_synchronize();
  while (s->ready[1 - side] < phase) {
  }
}

static void child(Shared* s, int side, int rounds) {
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  load_memops();
  CK(cudaHostRegister((void*)s, 4096, cudaHostRegisterMapped | cudaHostRegisterPortable));
  Shared* d = nullptr;
  CK(cudaHostGetDevicePointer((void**)&d, (void*)s, 0));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  volatile unsigned int* mine = &d->word[side][0];
  volatile unsigned int* peer = &d->word[1 - side][0];
  unsigned int base = 0;
  int phase = 1;
  const char* modes[] = {"kernel", "launches", "memops", "host", "kern-host"};
  for (int m = 0; m < 5; ++m) {
    for (int rep = 0; rep < 2; ++rep) {  // rep 0 warms up
      barrier(s, side, phase++);
      double t0 = now_us(), issue = 0;
      if (m == 0 || (m == 4 && side == 0)) {
        whole<<<1, 1, 0, st>>>(mine, peer, side, base, rounds, &d->gave_up);
        issue = now_us() - t0;
        CK(cudaStreamSynchronize(st));
      } else if (m == 1) {
        for (int i = 1; i <= rounds; ++i) one<<<1, 1, 0, st>>>(mine, peer, side, base + i, &d->gave_up);
        issue = now_us() - t0;
        CK(cudaStreamSynchronize(st));
      } else if (m == 2) {
        CUdeviceptr pm = (CUdeviceptr)(uintptr_t)mine, pp = (CUdeviceptr)(uintptr_t)peer;
        for (int i = 1; i <= rounds; ++i) {
          unsigned int v = base + i;
          if (side == 0) {
            CKD(write_value32((CUstream)st, pm, v, 0));
            CKD(wait_value32((CUstream)st, pp, v, CU_STREAM_WAIT_VALUE_GEQ));
          } else {
            CKD(wait_value32((CUstream)st, pp, v, CU_STREAM_WAIT_VALUE_GEQ));
            CKD(write_value32((CUstream)st, pm, v, 0));
          }
        }
        issue = now_us() - t0;
        CK(cudaStreamSynchronize(st));
      } else {  // host, and kern-host's side 1
        volatile unsigned int* hm = &s->word[side][0];
        volatile unsigned int* hp = &s->word[1 - side][0];
        for (int i = 1; i <= rounds; ++i) {
          unsigned int v = base + i;
          if (side == 0) {
            *hm = v;
            __sync_synchronize();
            while (*hp < v) {
            }
          } else {
            while (*hp < v) {
            }
            *hm = v;
            __sync_synchronize();
          }
        }
      }
      double dt = now_us() - t0;
      base += rounds;
      if (s->gave_up) {
        if (side == 0) printf("%-9s gave up (a spin passed 5 s)\n", modes[m]);
        exit(3);
      }
      if (rep == 1 && side == 0)
        printf("%-9s %8.2f us per round trip  (%d rounds, %.0f us in all, issue %.1f us)\n", modes[m],
               dt / rounds, rounds, dt, issue);
      fflush(stdout);
    }
  }
  CK(cudaStreamDestroy(st));
  CK(cudaHostUnregister((void*)s));
}

int main(int argc, char** argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 2000;
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return 1;
  memset(p, 0, 4096);
  Shared* s = (Shared*)p;
  pid_t kids[2];
  for (int side = 0; side < 2; ++side) {
    kids[side] = fork();
    if (kids[side] == 0) {
      child(s, side, rounds);
      _exit(0);
    }
  }
  int rc = 0;
  for (int side = 0; side < 2; ++side) {
    int st = 0;
    waitpid(kids[side], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  return rc;
}
