/* One process of an nccl-tests-style job through the drop-in NCCL (tests/test_dropin.py):
 * this process makes its `local` ranks [first, first+local) of an `nranks` job from ONE thread
 * inside ncclGroupStart/End (NCCL's one-thread-several-devices pattern, nccl-tests -g N), then
 * runs an all_reduce on every one of them inside one group, each on a stream of its own (the
 * emulated device's streams: HETCCL_CAPI_DEVICE=emulated), and checks the sums exactly.
 * It also checks that a communicator whose init waits for ncclGroupEnd refuses a call with a
 * clear error, and that a call refused inside a group by the drop-in itself fails at
 * once and cancels its group, as NCCL's ncclGroupErrCheck (a bad rank, a NULL communicator): ncclGroupEnd returns that error and
 * launches none of the group's calls; the next group works.
 * argv: id-file nranks first local [abort]. Rank 0's process writes the unique id to id-file.
 * "abort" (two processes of one rank each): rank 0 issues a group of device-route all_reduces
 * that rank 1 never joins and another thread aborts the communicator while ncclGroupEnd issues
 * them (torch's watchdog): ncclGroupEnd must return an error, not crash or hang.
 * Prints "ok" and exits 0, or names what went wrong and exits 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "hetccl.h"
#include "nccl/nccl_abi.h"

HETCCL_NCCL_API hetcclComm_t hetcclDropinComm(ncclComm_t comm);

/* NCCL 2.22's layout (nccl.h: NCCL_SIM_INFO_INITIALIZER); the drop-in only passes it on */
struct ncclSimInfo_v22200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  float estimatedTime;
};

#define FAIL(...)                  \
  do {                             \
    fprintf(stderr, __VA_ARGS__);  \
    fprintf(stderr, "\n");         \
    return 1;                      \
  } while (0)
#define NCCL(call)                                                                               \
  do {                                                                                           \
    ncclResult_t r_ = (call);                                                                    \
    if (r_ != ncclSuccess) FAIL("%s: %d: %s", #call, (int)r_, ncclGetLastError(NULL));            \
  } while (0)

enum { COUNT = 4096, MAXLOCAL = 8 };  /* 16 KiB: the device route where HETCCL_STREAM_DEVICE_BYTES is below */

static void* abort_later(void* arg) {
  usleep(1000 * 1000);
  ncclCommAbort(*(ncclComm_t*)arg);
  return NULL;
}

static int abort_in_group(int first, ncclComm_t comm) {
  enum { N = 1 << 16 };
  static float a[N], b[N];
  void* stream = NULL;
  if (hetcclTestStreamCreate(hetcclDropinComm(comm), &stream) != hetcclSuccess)
    FAIL("no test stream: %s", hetcclGetLastError(NULL));
  if (first != 0) {  /* rank 1: never calls; leaves once rank 0 has given up */
    sleep(6);
    printf("ok\n");
    return 0;
  }
  pthread_t th;
  if (pthread_create(&th, NULL, abort_later, &comm) != 0) FAIL("pthread_create");
  time_t t0 = time(NULL);
  NCCL(ncclGroupStart());
  for (int k = 0; k < 3; ++k) NCCL(ncclAllReduce(a, b, N, ncclFloat, ncclSum, comm, stream));
  ncclResult_t r = ncclGroupEnd();
  pthread_join(th, NULL);
  if (r == ncclSuccess) FAIL("ncclGroupEnd succeeded although its communicator was aborted");
  if (time(NULL) - t0 > 20) FAIL("ncclGroupEnd returned only after %ld s", (long)(time(NULL) - t0));
  printf("ok\n");
  return 0;
}

/* Synchronizes every local communicator's stream, then checks recv[i][k] against want(rank, k)
 * (rank: first + i); `what` names the step in the failure. */
static int check_recv(const char* what, int local, int first, int nranks, ncclComm_t* comms, void** streams,
                      float** recv, float (*want)(int rank, int nranks, int k)) {
  for (int i = 0; i < local; ++i) {
    if (hetcclTestStreamSynchronize(hetcclDropinComm(comms[i]), streams[i]) != hetcclSuccess)
      FAIL("%s: stream of communicator %d: %s", what, i, hetcclGetLastError(NULL));
    for (int k = 0; k < COUNT; ++k) {
      float w = want(first + i, nranks, k);
      if (recv[i][k] != w) FAIL("%s: rank %d element %d: %g, not %g", what, first + i, k, recv[i][k], w);
    }
  }
  return 0;
}

/* every rank's send is (rank + 1) * (k % 97 + 1): the sum is exact in float32 */
static float all_reduced(int rank, int nranks, int k) {
  (void)rank;
  return (float)(nranks * (nranks + 1) / 2 * (k % 97 + 1));
}
/* a ring: rank r receives 1000 * (r - 1) + k */
static float from_left(int rank, int nranks, int k) { return (float)(1000 * ((rank + nranks - 1) % nranks) + k); }
/* not written: the receive buffers' fill */
static float untouched(int rank, int nranks, int k) {
  (void)rank, (void)nranks, (void)k;
  return -7.0f;
}

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) FAIL("usage: %s id-file nranks first local [abort]", argv[0]);
  const char* idfile = argv[1];
  int nranks = atoi(argv[2]), first = atoi(argv[3]), local = atoi(argv[4]);
  if (local < 1 || local > MAXLOCAL) FAIL("local must be 1..%d", MAXLOCAL);
  ncclUniqueId id;
  if (first == 0) {
    NCCL(ncclGetUniqueId(&id));
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", idfile);
    FILE* f = fopen(tmp, "wb");
    if (!f || fwrite(&id, sizeof id, 1, f) != 1 || fclose(f) != 0) FAIL("cannot write %s", tmp);
    if (rename(tmp, idfile) != 0) FAIL("cannot rename %s", tmp);
  } else {
    FILE* f = NULL;
    for (int i = 0; i < 6000 && !(f = fopen(idfile, "rb")); ++i) usleep(10000);
    if (!f || fread(&id, sizeof id, 1, f) != 1) FAIL("no unique id in %s", idfile);
    fclose(f);
  }

  if (argc == 6) {  /* abort while ncclGroupEnd issues the group */
    ncclComm_t comm;
    NCCL(ncclCommInitRank(&comm, nranks, id, first));
    return abort_in_group(first, comm);
  }

  /* a bad rank inside a group fails at once; ncclGroupEnd returns it (the group is cancelled) */
  ncclComm_t bad = (ncclComm_t)1;
  NCCL(ncclGroupStart());
  ncclResult_t br = ncclCommInitRank(&bad, nranks, id, nranks);
  if (br != ncclInvalidArgument || bad != NULL || !strstr(ncclGetLastError(NULL), "not in [0, nranks)"))
    FAIL("a bad rank in a group: %d %p '%s'", (int)br, (void*)bad, ncclGetLastError(NULL));
  ncclResult_t bend = ncclGroupEnd();
  if (bend != ncclInvalidArgument || !strstr(ncclGetLastError(NULL), "not in [0, nranks)") ||
      !strstr(ncclGetLastError(NULL), "none of hetccl's calls"))
    FAIL("ncclGroupEnd after a refused init: %d '%s'", (int)bend, ncclGetLastError(NULL));

  /* a one-rank communicator destroyed while its init waits for ncclGroupEnd: dropped, the
     group ends cleanly; one made the same way and kept works */
  ncclUniqueId solo_id;
  ncclComm_t solo = NULL, kept = NULL;
  NCCL(ncclGetUniqueId(&solo_id));
  NCCL(ncclGroupStart());
  NCCL(ncclCommInitRank(&solo, 1, solo_id, 0));
  NCCL(ncclCommDestroy(solo));
  NCCL(ncclGroupEnd());
  NCCL(ncclGetUniqueId(&solo_id));
  NCCL(ncclGroupStart());
  NCCL(ncclCommInitRank(&kept, 1, solo_id, 0));
  NCCL(ncclGroupEnd());
  int kept_n = 0;
  NCCL(ncclCommCount(kept, &kept_n));
  if (kept_n != 1) FAIL("one-rank communicator of %d ranks", kept_n);
  NCCL(ncclCommDestroy(kept));

  ncclComm_t comms[MAXLOCAL];
  /* waiting for ncclGroupEnd: a call is refused with a clear error, not a hang or a crash; the
     refusal cancels the group (every process makes it): its inits do not run, and their
     communicators only refuse until destroyed */
  NCCL(ncclGroupStart());
  for (int i = 0; i < local; ++i) NCCL(ncclCommInitRank(&comms[i], nranks, id, first + i));
  float one = 1, out = 0;
  ncclResult_t early = ncclAllReduce(&one, &out, 1, ncclFloat, ncclSum, comms[0], NULL);
  if (early != ncclInvalidUsage || !strstr(ncclGetLastError(NULL), "waits for ncclGroupEnd"))
    FAIL("a call before ncclGroupEnd: %d '%s'", (int)early, ncclGetLastError(NULL));
  ncclResult_t cend = ncclGroupEnd();
  if (cend != ncclInvalidUsage || !strstr(ncclGetLastError(NULL), "none of hetccl's calls"))
    FAIL("ncclGroupEnd after a refused call: %d '%s'", (int)cend, ncclGetLastError(NULL));
  ncclResult_t after = ncclAllReduce(&one, &out, 1, ncclFloat, ncclSum, comms[0], NULL);
  if (after != ncclInvalidUsage || !strstr(ncclGetLastError(NULL), "init failed"))
    FAIL("a call on a cancelled init: %d '%s'", (int)after, ncclGetLastError(NULL));
  for (int i = 0; i < local; ++i) NCCL(ncclCommDestroy(comms[i]));

  NCCL(ncclGroupStart());
  for (int i = 0; i < local; ++i) NCCL(ncclCommInitRank(&comms[i], nranks, id, first + i));
  ncclResult_t pending = ncclSuccess;
  NCCL(ncclCommGetAsyncError(comms[0], &pending));
  if (pending != ncclInProgress) FAIL("async error of a waiting init: %d, not ncclInProgress", (int)pending);
  NCCL(ncclGroupEnd());

  void* streams[MAXLOCAL];
  float* send[MAXLOCAL];
  float* recv[MAXLOCAL];
  for (int i = 0; i < local; ++i) {
    int count = 0, rank = -1;
    ncclResult_t ae = ncclInternalError;
    NCCL(ncclCommCount(comms[i], &count));
    NCCL(ncclCommUserRank(comms[i], &rank));
    NCCL(ncclCommGetAsyncError(comms[i], &ae));
    if (count != nranks || rank != first + i || ae != ncclSuccess)
      FAIL("communicator %d: count %d rank %d async %d", i, count, rank, (int)ae);
    if (hetcclTestStreamCreate(hetcclDropinComm(comms[i]), &streams[i]) != hetcclSuccess)
      FAIL("no test stream: %s", hetcclGetLastError(NULL));
    send[i] = malloc(COUNT * sizeof(float));
    recv[i] = malloc(COUNT * sizeof(float));
    for (int k = 0; k < COUNT; ++k) send[i][k] = (float)((first + i + 1) * (k % 97 + 1));
  }
  for (int rep = 0; rep < 3; ++rep) {
    NCCL(ncclGroupStart());
    for (int i = 0; i < local; ++i)
      NCCL(ncclAllReduce(send[i], recv[i], COUNT, ncclFloat, ncclSum, comms[i], streams[i]));
    NCCL(ncclGroupEnd());
    if (check_recv("all_reduce", local, first, nranks, comms, streams, recv, all_reduced)) return 1;
  }
  /* a call refused inside a group (every rank makes the same bad call) cancels the group:
     ncclGroupEnd returns its error and the group's good calls are not launched either */
  for (int i = 0; i < local; ++i)
    for (int k = 0; k < COUNT; ++k) recv[i][k] = -7.0f;
  NCCL(ncclGroupStart());
  for (int i = 0; i < local; ++i)
    NCCL(ncclAllReduce(send[i], recv[i], COUNT, ncclFloat, ncclSum, comms[i], streams[i]));
  ncclResult_t refused = ncclAllReduce(send[0], recv[0], COUNT, ncclFloat, ncclSum, NULL, streams[0]);
  if (refused != ncclInvalidArgument) FAIL("a NULL communicator inside a group: %d, not ncclInvalidArgument", (int)refused);
  ncclResult_t gend = ncclGroupEnd();
  if (gend != ncclInvalidArgument || !strstr(ncclGetLastError(NULL), "none of hetccl's calls"))
    FAIL("ncclGroupEnd of a group with a refused call: %d '%s'", (int)gend, ncclGetLastError(NULL));
  if (check_recv("a cancelled group ran", local, first, nranks, comms, streams, recv, untouched)) return 1;
  /* a split refused inside a group (newcomm NULL on every rank) cancels it the same way */
  NCCL(ncclGroupStart());
  for (int i = 0; i < local; ++i)
    NCCL(ncclAllReduce(send[i], recv[i], COUNT, ncclFloat, ncclSum, comms[i], streams[i]));
  refused = ncclCommSplit(comms[0], 0, first, NULL, NULL);
  if (refused != ncclInvalidArgument) FAIL("a split with newcomm NULL inside a group: %d, not ncclInvalidArgument", (int)refused);
  gend = ncclGroupEnd();
  if (gend != ncclInvalidArgument || !strstr(ncclGetLastError(NULL), "none of hetccl's calls"))
    FAIL("ncclGroupEnd of a group with a refused split: %d '%s'", (int)gend, ncclGetLastError(NULL));
  if (check_recv("a group with a refused split ran", local, first, nranks, comms, streams, recv, untouched)) return 1;
  /* HETCCL_TEST_SPLIT_ORDER (every process makes two or more hetccl ranks): a split of one
     communicator inside a group that also holds calls on another is refused (the drop-in would
     have to issue the parent's calls before the others'), and that refusal cancels the group */
  if (getenv("HETCCL_TEST_SPLIT_ORDER")) {
    ncclComm_t child = (ncclComm_t)&child;
    NCCL(ncclGroupStart());
    for (int i = 0; i < local; ++i)
      NCCL(ncclAllReduce(send[i], recv[i], COUNT, ncclFloat, ncclSum, comms[i], streams[i]));
    refused = ncclCommSplit(comms[0], 0, first, &child, NULL);
    if (refused != ncclInvalidUsage || child != NULL)
      FAIL("a split beside another communicator's calls in a group: %d, child %p", (int)refused, (void*)child);
    gend = ncclGroupEnd();
    if (gend != ncclInvalidUsage || !strstr(ncclGetLastError(NULL), "other communicators"))
      FAIL("ncclGroupEnd of a group with a refused split: %d '%s'", (int)gend, ncclGetLastError(NULL));
    if (check_recv("a group with a refused split ran", local, first, nranks, comms, streams, recv, untouched)) return 1;
  }
  NCCL(ncclGroupStart());  /* the next group runs */
  for (int i = 0; i < local; ++i)
    NCCL(ncclAllReduce(send[i], recv[i], COUNT, ncclFloat, ncclSum, comms[i], streams[i]));
  NCCL(ncclGroupEnd());
  if (check_recv("after a cancelled group", local, first, nranks, comms, streams, recv, all_reduced)) return 1;

  /* HETCCL_EXPECT_DEVICE_ROUTE: the all_reduces above took the device route */
  if (getenv("HETCCL_EXPECT_DEVICE_ROUTE")) {
    char info[8192];
    if (hetcclCommInfo(hetcclDropinComm(comms[0]), info, sizeof info) != hetcclSuccess)
      FAIL("hetcclCommInfo: %s", hetcclGetLastError(NULL));
    if (!strstr(info, "algo_all_reduce_ring_device=")) FAIL("no device-route all_reduce ran: %s", info);
  }

  /* a ring of sends and receives over every local rank, all in one group of this thread */
  for (int i = 0; i < local; ++i)
    for (int k = 0; k < COUNT; ++k) send[i][k] = (float)(1000 * (first + i) + k);
  NCCL(ncclGroupStart());
  for (int i = 0; i < local; ++i) {
    int r = first + i;
    NCCL(ncclSend(send[i], COUNT, ncclFloat, (r + 1) % nranks, comms[i], streams[i]));
    NCCL(ncclRecv(recv[i], COUNT, ncclFloat, (r + nranks - 1) % nranks, comms[i], streams[i]));
  }
  NCCL(ncclGroupEnd());
  if (check_recv("ring", local, first, nranks, comms, streams, recv, from_left)) return 1;

  /* ncclGroupSimulateEnd launches nothing, as NCCL's: the receive buffers stay as they were */
  for (int i = 0; i < local; ++i)
    for (int k = 0; k < COUNT; ++k) recv[i][k] = -7.0f;
  struct ncclSimInfo_v22200 sim = {sizeof sim, 0x74685283u, 22200u, -1.0f};
  NCCL(ncclGroupStart());
  for (int i = 0; i < local; ++i)
    NCCL(ncclAllReduce(send[i], recv[i], COUNT, ncclFloat, ncclSum, comms[i], streams[i]));
  NCCL(ncclGroupSimulateEnd(&sim));
  if (check_recv("a simulated group ran", local, first, nranks, comms, streams, recv, untouched)) return 1;

  for (int i = 0; i < local; ++i) {
    NCCL(ncclCommDestroy(comms[i]));
    free(send[i]);
    free(recv[i]);
  }
  printf("ok\n");
  return 0;
}
