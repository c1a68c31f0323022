#!/usr/bin/env bash
# llama-cpp-python for bench/throughput.py's same-run llama.cpp baseline: built once from its
# PyPI source with this machine's compiler for this CPU's instruction sets (those /proc/cpuinfo
# lists, as GGML_NATIVE would pick, but AMX off: its tiles need the kernel's permission, which
# sandboxes may refuse, and the AMX matmul crashed on such a machine), the wheel cached under
# ~/.cache/paged/wheels/<flags>, then installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
CMAKE_ARGS+=" -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni)"
CMAKE_ARGS+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
CMAKE_ARGS+=" -DGGML_AVX512_BF16=$(has avx512_bf16)"
CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS+=" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF"
key=$(echo "$VERSION $CMAKE_ARGS" | sha256sum | cut -c1-12)
CACHE=${PAGED_WHEEL_CACHE:-$HOME/.cache/paged/wheels}/llama-cpp-$key
mkdir -p "$CACHE"
if ! ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION ($CMAKE_ARGS)"
    CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        "$VENV/bin/python" -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python \
        -w "$CACHE" "llama-cpp-python==$VERSION"
fi
# The cached wheel (a binary wins over the index's sdist); its pure-Python deps from the index.
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$CACHE"/llama_cpp_python-"$VERSION"-*.whl
"$VENV/bin/python" -m pip install -q --find-links "$CACHE" --prefer-binary "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
