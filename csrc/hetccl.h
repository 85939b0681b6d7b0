/* hetccl C API: the product's core, for faces without torch (the harnesses, and next the
 * drop-in NCCL/RCCL library of issue 25). Shaped after NCCL's API so that mapping NCCL's ABI onto
 * it is one to one: the same enum values (hetcclResult_t, hetcclDataType_t, hetcclRedOp_t), the
 * same argument order, a 128-byte unique id that one rank creates and every rank receives out of
 * band.
 *
 * What this revision does (docs/capi.md says the same, with the trade-offs):
 *  - Bootstrap of its own (csrc/api/bootstrap.cc): hetcclGetUniqueId opens a root listener in the
 *    calling process; every rank's hetcclCommInitRank sends its entry (host identity, vendor label,
 *    transport addresses) to the root, which returns the whole table to every rank once: O(n)
 *    connections and messages in total, no all-pairs handshake. Works between hosts.
 *  - Connections only for the peers the algorithms use: the ring neighbours on the same host
 *    over shared memory, every other peer over tcp dialled on first use (lazy). Per rank, shared
 *    memory is constant and tcp connections are constant (rings) or log2 n (recursive doubling).
 *  - Collectives: all_reduce, reduce, reduce_scatter, all_gather, broadcast, all_to_all (rings,
 *    pairwise exchange, or recursive doubling for small all_reduces when the rank count is a
 *    power of two, on the engine's plans: csrc/api/select.cc, coll_*.cc), send/recv, group
 *    start/end for send/recv.
 *  - stream NULL: host memory, the call returns when it is done. A stream (or
 *    HETCCL_STREAM_DEFAULT): memory the stream's copies reach (device memory), stream-ordered:
 *    the call enqueues copies and waits on the stream and returns; the collective runs on the
 *    communicator's executor thread on pinned staging memory (csrc/api/stream_path.h). The
 *    device runtime is HETCCL_CAPI_DEVICE (cuda by default, hip; emulated for tests).
 *  - Argument check (on by default, HETCCL_CHECK_ARGS=0 turns it off): the ranks all-gather a
 *    header (collective, count, dtype, op, root) before any data moves; a difference returns
 *    hetcclInvalidArgument on every rank with the same text (hetcclGetLastError), and the
 *    communicator stays usable.
 *  - Failure: a dead peer or a timeout returns hetcclRemoteError / hetcclSystemError with the
 *    text in hetcclGetLastError; the communicator is then broken (later calls fail at once,
 *    hetcclCommGetAsyncError reports it). hetcclCommAbort frees it without waiting.
 * Host calls (stream NULL) block the calling thread; stream calls do not. One
 * communicator must not be used by two threads at once (as NCCL).
 */
#ifndef HETCCL_H_
#define HETCCL_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default)

#define HETCCL_MAJOR 0
#define HETCCL_MINOR 1
#define HETCCL_PATCH 0
#define HETCCL_VERSION_CODE (HETCCL_MAJOR * 10000 + HETCCL_MINOR * 100 + HETCCL_PATCH)

#define HETCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[HETCCL_UNIQUE_ID_BYTES];
} hetcclUniqueId;

typedef struct hetcclComm* hetcclComm_t;

/* NCCL's values (nccl.h), so that the drop-in passes them through unchanged. */
typedef enum {
  hetcclSuccess = 0,
  hetcclUnhandledCudaError = 1,
  hetcclSystemError = 2,
  hetcclInternalError = 3,
  hetcclInvalidArgument = 4,
  hetcclInvalidUsage = 5,
  hetcclRemoteError = 6,
  hetcclInProgress = 7
} hetcclResult_t;

typedef enum {
  hetcclInt8 = 0, hetcclChar = 0,
  hetcclUint8 = 1,
  hetcclInt32 = 2, hetcclInt = 2,
  hetcclUint32 = 3,
  hetcclInt64 = 4,
  hetcclUint64 = 5,
  hetcclFloat16 = 6, hetcclHalf = 6,
  hetcclFloat32 = 7, hetcclFloat = 7,
  hetcclFloat64 = 8, hetcclDouble = 8,
  hetcclBfloat16 = 9
} hetcclDataType_t;

typedef enum {
  hetcclSum = 0,
  hetcclProd = 1,
  hetcclMax = 2,
  hetcclMin = 3,
  hetcclAvg = 4,
  hetcclNumOps = 5 /* operators of hetcclRedOpCreatePreMulSum start here (as NCCL's) */
} hetcclRedOp_t;

typedef enum { hetcclScalarDevice = 0, hetcclScalarHostImmediate = 1 } hetcclScalarResidence_t;

#define HETCCL_SPLIT_NOCOLOR (-1)

/* Version and errors. */
hetcclResult_t hetcclGetVersion(int* version);
const char* hetcclGetErrorString(hetcclResult_t result);
/* The text of the last error on this thread or, with a communicator, of that communicator's
 * last error ("" when none). The pointer stays valid until the next call on the same thread. */
const char* hetcclGetLastError(hetcclComm_t comm);

/* Communicators. */
hetcclResult_t hetcclGetUniqueId(hetcclUniqueId* uniqueId);
hetcclResult_t hetcclCommInitRank(hetcclComm_t* comm, int nranks, hetcclUniqueId commId, int rank);
hetcclResult_t hetcclCommDestroy(hetcclComm_t comm);
hetcclResult_t hetcclCommAbort(hetcclComm_t comm);
/* The first half of an abort, for a caller that must not free yet (the drop-in while another of
 * its threads still issues a group's calls): ends the waits of calls in progress and refuses
 * later calls; frees nothing. hetcclCommAbort or hetcclCommDestroy must follow. */
hetcclResult_t hetcclCommInterrupt(hetcclComm_t comm);
hetcclResult_t hetcclCommCount(const hetcclComm_t comm, int* count);
hetcclResult_t hetcclCommUserRank(const hetcclComm_t comm, int* rank);
/* hetcclSuccess while healthy; else the error that broke the communicator. */
hetcclResult_t hetcclCommGetAsyncError(hetcclComm_t comm, hetcclResult_t* asyncError);
/* Ranks with the same color form a new communicator, ordered by key then by rank; color
 * HETCCL_SPLIT_NOCOLOR gives *newcomm = NULL. Collective over comm (host calls on it). */
hetcclResult_t hetcclCommSplit(hetcclComm_t comm, int color, int key, hetcclComm_t* newcomm);
/* A new communicator of comm's ranks but the nexclude listed in exclude (NCCL's
 * ncclCommShrink): every rank not listed calls it (survivors of the same list shrink in the
 * same order); the listed ranks do not. The new ranks keep comm's order. No collective over comm: the
 * lowest surviving rank makes the new unique id and sends it to every other survivor's
 * bootstrap listener, so it works on a communicator broken by a dead peer (listed). flags:
 * HETCCL_SHRINK_ABORT first aborts comm's calls in flight (comm is then unusable: destroy it);
 * HETCCL_SHRINK_DEFAULT leaves comm as it is (usable if it was). */
#define HETCCL_SHRINK_DEFAULT 0
#define HETCCL_SHRINK_ABORT 1
hetcclResult_t hetcclCommShrink(hetcclComm_t comm, const int* exclude, int nexclude, hetcclComm_t* newcomm,
                                int flags);
/* The number of vendor groups (distinct HETCCL_VENDOR labels) among the ranks, and this rank's
 * group's size (either pointer may be NULL). */
hetcclResult_t hetcclCommVendorGroups(hetcclComm_t comm, int* ngroups, int* mygroupsize);
/* NCCL's PreMulSum: each rank's input is multiplied by its scalar (of datatype; host
 * immediate: read now; device: read when each call runs, through the stream) before the sum. */
hetcclResult_t hetcclRedOpCreatePreMulSum(hetcclRedOp_t* op, void* scalar, hetcclDataType_t datatype,
                                          hetcclScalarResidence_t residence, hetcclComm_t comm);
hetcclResult_t hetcclRedOpDestroy(hetcclRedOp_t op, hetcclComm_t comm);
/* One line "key=value key=value ..." about the communicator (transports per peer, sockets held,
 * shared-memory bytes, engine counters), for harnesses and `hetccl doctor`. Writes at most len
 * bytes including the terminating NUL; returns hetcclInvalidArgument if it did not fit. */
hetcclResult_t hetcclCommInfo(hetcclComm_t comm, char* buf, size_t len);

/* hetccl extension for faces with a work object (the torch face), not in NCCL's API. With
 * enable != 0, a stream call of this communicator that takes the device route returns once it
 * is handed to the communicator's executor: the caller's stream is not yet ordered after it.
 * *ticket (may be NULL) receives the address of a word that each later call on this
 * communicator sets before it returns: the call's ticket, or 0 where the call needs no join.
 * hetcclCommJoin(comm, ticket, stream) then orders `stream` after that call and every earlier
 * one (on the host it waits until the route has enqueued the call; it enqueues a wait on
 * stream); joining twice, on several streams, or never is allowed. Any other call is ordered
 * after every deferred call on its own stream before it runs, so calls still see each other's
 * results in issue order. Issuing thread only (as every call). */
hetcclResult_t hetcclCommDeferJoin(hetcclComm_t comm, int enable, const unsigned long long** ticket);
hetcclResult_t hetcclCommJoin(hetcclComm_t comm, unsigned long long ticket, void* stream);

/* The device's default stream (what NULL means to the vendor runtime): NULL itself is taken by
 * host calls. The drop-in NCCL passes a caller's NULL stream as this. */
#define HETCCL_STREAM_DEFAULT ((void*)1)

/* Collectives. stream: NULL (host memory, blocking) or a stream (stream-ordered). In place: sendbuff ==
 * recvbuff (all_reduce, broadcast), sendbuff == recvbuff + rank * count (all_gather),
 * recvbuff == sendbuff + rank * recvcount (reduce_scatter), as NCCL. */
hetcclResult_t hetcclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                               hetcclDataType_t datatype, hetcclRedOp_t op, hetcclComm_t comm,
                               void* stream);
/* recvbuff is written on the root only. */
hetcclResult_t hetcclReduce(const void* sendbuff, void* recvbuff, size_t count,
                            hetcclDataType_t datatype, hetcclRedOp_t op, int root, hetcclComm_t comm,
                            void* stream);
/* count elements to and from every rank (block p of sendbuff goes to rank p, block p of recvbuff
 * comes from rank p); sendbuff == recvbuff works in place. */
hetcclResult_t hetcclAllToAll(const void* sendbuff, void* recvbuff, size_t count,
                              hetcclDataType_t datatype, hetcclComm_t comm, void* stream);
hetcclResult_t hetcclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                               hetcclDataType_t datatype, int root, hetcclComm_t comm, void* stream);
hetcclResult_t hetcclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                               hetcclDataType_t datatype, hetcclComm_t comm, void* stream);
hetcclResult_t hetcclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                   hetcclDataType_t datatype, hetcclRedOp_t op, hetcclComm_t comm,
                                   void* stream);

/* Point to point: messages between a pair match in the order they were posted (as NCCL); a
 * send to this rank itself matches its receive from itself in the same group. Outside
 * a group, each call returns once its data has left (send) or arrived (recv); inside
 * hetcclGroupStart/End the calls only post, and hetcclGroupEnd waits for all of them, so a pair
 * can exchange in both directions. */
hetcclResult_t hetcclSend(const void* sendbuff, size_t count, hetcclDataType_t datatype, int peer,
                          hetcclComm_t comm, void* stream);
hetcclResult_t hetcclRecv(void* recvbuff, size_t count, hetcclDataType_t datatype, int peer,
                          hetcclComm_t comm, void* stream);
hetcclResult_t hetcclGroupStart(void);
hetcclResult_t hetcclGroupEnd(void);

/* Tests: a stream of the emulated device runtime (HETCCL_CAPI_DEVICE=emulated: host threads
 * as streams, its "device memory" is host memory), and waiting until a stream has run
 * everything enqueued on it. hetcclInvalidUsage with any other runtime. */
hetcclResult_t hetcclTestStreamCreate(hetcclComm_t comm, void** stream);
hetcclResult_t hetcclTestStreamSynchronize(hetcclComm_t comm, void* stream);

#pragma GCC visibility pop
#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* HETCCL_H_ */
