// loom/comm/all.hpp — every communicator this build can use, in one include.
//
// Example:
//   #include <loom/comm/all.hpp>
//   loom::LocalCommunicator comm;                         // world size 1
//   comm.all_reduce(t, loom::ReduceOp::sum);               // t unchanged
//
// Contents: the Communicator / AsyncCommunicator concepts and ReduceOp (communicator.hpp),
// LocalCommunicator (local.hpp), GlooCommunicator (gloo.hpp, when
// the build has Gloo: LOOM_HAS_GLOO), NcclCommunicator (nccl.hpp, when the build has NCCL and a
// LibTorch with CUDA: LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA, the condition under which
// loom/dist/process_group.hpp uses it). A build with NCCL but a CPU LibTorch includes
// <loom/comm/nccl.hpp> itself (its raw-pointer collectives). Guide: docs/comm.md.
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#if LOOM_HAS_GLOO
#include <loom/comm/gloo.hpp>
#endif
#if LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA
#include <loom/comm/nccl.hpp>
#endif
