/* NCCL's C ABI as the drop-in library exports it: the types and prototypes of nccl.h (NCCL
 * 2.28.9, the library torch 2.11 links; RCCL exports the same names and values), written out
 * here so that nothing is compiled against a vendor header. tests/test_dropin.py compares every
 * prototype below with the real nccl.h wherever one is found (the nvidia-nccl wheel).
 * Structures the drop-in only passes through (ncclConfig_t, ncclSimInfo_t, the device
 * communicator) stay opaque: their layout is the caller's and the real library's business. */
#ifndef HETCCL_NCCL_ABI_H_
#define HETCCL_NCCL_ABI_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;
typedef struct ncclConfig_v22800 ncclConfig_t;
typedef struct ncclSimInfo_v22200 ncclSimInfo_t;
typedef struct ncclDevComm ncclDevComm_t;
typedef struct ncclDevCommRequirements ncclDevCommRequirements_t;
typedef void* cudaStream_t; /* hipStream_t in RCCL: a pointer as well */

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
#define NCCL_SPLIT_NOCOLOR -1

typedef enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
               ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6, ncclInProgress = 7,
               ncclNumResults = 8 } ncclResult_t;

typedef enum { ncclNumOps_dummy = 5 } ncclRedOp_dummy_t;
typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5,
               ncclMaxRedOp = 0x7fffffff >> (32 - 8 * sizeof(ncclRedOp_dummy_t)) } ncclRedOp_t;

typedef enum { ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclInt32 = 2, ncclInt = 2, ncclUint32 = 3,
               ncclInt64 = 4, ncclUint64 = 5, ncclFloat16 = 6, ncclHalf = 6, ncclFloat32 = 7,
               ncclFloat = 7, ncclFloat64 = 8, ncclDouble = 8, ncclBfloat16 = 9, ncclFloat8e4m3 = 10,
               ncclFloat8e5m2 = 11, ncclNumTypes = 12 } ncclDataType_t;

typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;

#define HETCCL_NCCL_API __attribute__((visibility("default")))

/* prototypes: one per line, as nccl.h spells them (the test reads them from here) */
HETCCL_NCCL_API ncclResult_t ncclMemAlloc(void** ptr, size_t size);
HETCCL_NCCL_API ncclResult_t ncclMemFree(void* ptr);
HETCCL_NCCL_API ncclResult_t ncclGetVersion(int* version);
HETCCL_NCCL_API ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
HETCCL_NCCL_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config);
HETCCL_NCCL_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
HETCCL_NCCL_API ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);
HETCCL_NCCL_API ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId, ncclUniqueId* commIds, ncclConfig_t* config);
HETCCL_NCCL_API ncclResult_t ncclCommFinalize(ncclComm_t comm);
HETCCL_NCCL_API ncclResult_t ncclCommDestroy(ncclComm_t comm);
HETCCL_NCCL_API ncclResult_t ncclCommAbort(ncclComm_t comm);
HETCCL_NCCL_API ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags);
HETCCL_NCCL_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config);
HETCCL_NCCL_API ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);
HETCCL_NCCL_API const char* ncclGetErrorString(ncclResult_t result);
HETCCL_NCCL_API const char* ncclGetLastError(ncclComm_t comm);
HETCCL_NCCL_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
HETCCL_NCCL_API ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
HETCCL_NCCL_API ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
HETCCL_NCCL_API ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
HETCCL_NCCL_API ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle);
HETCCL_NCCL_API ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle);
HETCCL_NCCL_API ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags);
HETCCL_NCCL_API ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
HETCCL_NCCL_API ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype, ncclScalarResidence_t residence, ncclComm_t comm);
HETCCL_NCCL_API ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
HETCCL_NCCL_API ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream);
HETCCL_NCCL_API ncclResult_t ncclGroupStart(void);
HETCCL_NCCL_API ncclResult_t ncclGroupEnd(void);
HETCCL_NCCL_API ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* simInfo);
HETCCL_NCCL_API ncclResult_t ncclDevCommCreate(ncclComm_t comm, ncclDevCommRequirements_t const* reqs, ncclDevComm_t* outDevComm);
HETCCL_NCCL_API ncclResult_t ncclDevCommDestroy(ncclComm_t comm, ncclDevComm_t const* devComm);

#ifdef __cplusplus
}
#endif

#endif /* HETCCL_NCCL_ABI_H_ */
