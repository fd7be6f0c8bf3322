#!/usr/bin/env bash
# The CMake flags llama.cpp (ggml) is built with here, for llama-cpp-python (scripts/bootstrap.sh)
# and llama-server (scripts/build_llama_server.sh) alike. Printed on stdout; nothing when ggml's
# own default (-march=native) is right for this machine.
#
# Some virtual machines advertise AMX in /proc/cpuinfo without enabling its register state: a
# -march=native build then takes ggml's AMX kernels and dies (SIGILL or SIGSEGV at `ldtilecfg`) in
# the first quantized matmul, so the default GGUF pair crashes as it loads. There, this probes AMX
# with a tiny program and, when it faults, builds for the same instruction sets without AMX.
set -uo pipefail

grep -qw amx_tile /proc/cpuinfo 2>/dev/null || exit 0
command -v cc >/dev/null || exit 0
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
cat >"$probe/amx.c" <<'EOF'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
    unsigned char config[64];
    memset(config, 0, sizeof config);
    config[0] = 1;                /* palette 1 */
    config[16] = 64; config[48] = 16;  /* tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF
if cc -O1 -mamx-tile -o "$probe/amx" "$probe/amx.c" 2>/dev/null && ("$probe/amx"; exit $?) 2>/dev/null; then
    exit 0  # AMX works: ggml's native build may use it
fi
flags="-DGGML_NATIVE=OFF"
has() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; }
for pair in avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 \
    avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if has "${pair%%:*}"; then flags+=" -DGGML_${pair#*:}=ON"; else flags+=" -DGGML_${pair#*:}=OFF"; fi
done
echo "$flags"
