#!/bin/sh
# Builds tests/cpp/ucx_smoke (no Python) against the libucx wheel, or a UCX at $UCX_PREFIX.
# Output: build/ucx_smoke. Links the core's C++ files except bindings.cc, engine*.cc and csrc/device/.
set -e
cd "$(dirname "$0")/../.."
UCX_PREFIX=${UCX_PREFIX:-$(python -c "import libucx, os; print(os.path.dirname(libucx.__file__))")}
mkdir -p build
# Every transport file registers itself (HETCCL_REGISTER_TRANSPORT); link them all.
SRCS="csrc/reduce.cc csrc/transport.cc $(ls csrc/*_transport.cc | tr '\n' ' ')"
CXX="g++ -std=c++17 -O2 -g -Wall -Wextra -Wno-unused-parameter -Icsrc -I$UCX_PREFIX/include"
OBJS=""
mkdir -p build/obj
for src in tests/cpp/ucx_smoke.cc $SRCS; do  # recompile only what changed (headers: csrc/*.h)
  obj=build/obj/$(basename "$src" .cc).o
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ] || [ -n "$(find csrc -name '*.h' -newer "$obj")" ]; then
    $CXX -c "$src" -o "$obj"
  fi
  OBJS="$OBJS $obj"
done
g++ $OBJS -L"$UCX_PREFIX/lib" -Wl,-rpath,"$UCX_PREFIX/lib" -lucp -lucs -pthread -lrt -o build/ucx_smoke
echo build/ucx_smoke
