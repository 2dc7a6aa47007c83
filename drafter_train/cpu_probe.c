/* Runs one instruction of one of ggml's x86 instruction groups: exits 0 when this process can execute it, dies with
 * SIGILL (or exits non-zero) when it cannot. llamacpp_flags.py compiles it once per group (-DPROBE_<GROUP>
 * plus that group's -m flags, the ones ggml-cpu's CMakeLists adds for GGML_<GROUP>) and turns on only the groups
 * whose probe ran. /proc/cpuinfo (CPUID) is not enough: a virtual machine can list an extension it does not let a
 * process execute, and ggml's own GGML_NATIVE (-march=native) and GGML_CPU_ALL_VARIANTS trust CPUID alone.
 * The results go through volatile memory so the compiler cannot fold the instruction away. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#if defined(PROBE_AMX_TILE) || defined(PROBE_AMX_INT8) || defined(PROBE_AMX_BF16)
#include <sys/syscall.h>
#include <unistd.h>
#define PROBE_AMX 1
#endif

static volatile float vf[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static volatile int32_t vi[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static volatile uint16_t vh[16] = {0x3c00, 0x4000};
static volatile float out_f;
static volatile int64_t out_i;

#ifdef PROBE_AMX
/* Linux refuses tile data to a process that has not asked for it (ggml's amx.cpp asks the same way); a refusal means
 * ggml would not use AMX either, so the group is reported unusable. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static int8_t tile_a[16 * 64], tile_b[16 * 64];
static int32_t tile_c[16 * 16];

static int amx_probe(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 3;
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    memset(tile_a, 1, sizeof tile_a), memset(tile_b, 1, sizeof tile_b);
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, tile_a, 64);
    _tile_loadd(2, tile_b, 64);
#if defined(PROBE_AMX_INT8)
    _tile_dpbssd(0, 1, 2);
#elif defined(PROBE_AMX_BF16)
    _tile_dpbf16ps(0, 1, 2);
#endif
    _tile_stored(0, tile_c, 64);
    _tile_release();
    out_i = tile_c[0];
    return 0;
}
#endif

int main(void) {
#if defined(PROBE_SSE42)
    out_i = _mm_crc32_u32(0, (uint32_t)vi[0]);
#elif defined(PROBE_AVX)
    __m256 a = _mm256_loadu_ps((const float *)vf);
    out_f = _mm256_cvtss_f32(_mm256_add_ps(a, a));
#elif defined(PROBE_F16C)
    out_f = _mm_cvtss_f32(_mm_cvtph_ps(_mm_loadu_si128((const __m128i *)vh)));
#elif defined(PROBE_FMA)
    __m256 a = _mm256_loadu_ps((const float *)vf);
    out_f = _mm256_cvtss_f32(_mm256_fmadd_ps(a, a, a));
#elif defined(PROBE_AVX2)
    __m256i a = _mm256_loadu_si256((const __m256i *)vi);
    out_i = _mm256_extract_epi32(_mm256_add_epi32(a, a), 0);
#elif defined(PROBE_BMI2)
    out_i = _pdep_u32((uint32_t)vi[3], 0x0f0fu);
#elif defined(PROBE_AVX_VNNI)
    __m256i a = _mm256_loadu_si256((const __m256i *)vi);
    out_i = _mm256_extract_epi32(_mm256_dpbusd_avx_epi32(a, a, a), 0);
#elif defined(PROBE_AVX512)
    /* GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: one instruction of each */
    __m512i a = _mm512_loadu_si512((const void *)vi);
    __m512i b = _mm512_add_epi8(_mm512_conflict_epi32(a), _mm512_mullo_epi64(a, a));
    __m256i c = _mm256_mask_add_epi32(_mm512_castsi512_si256(b), 0x55, _mm512_castsi512_si256(a),
                                      _mm512_castsi512_si256(a));
    out_i = _mm256_extract_epi32(c, 0) + _mm512_reduce_add_epi32(b);
#elif defined(PROBE_AVX512_VBMI)
    __m512i a = _mm512_loadu_si512((const void *)vi);
    out_i = _mm512_reduce_add_epi32(_mm512_permutexvar_epi8(a, a));
#elif defined(PROBE_AVX512_VNNI)
    __m512i a = _mm512_loadu_si512((const void *)vi);
    out_i = _mm512_reduce_add_epi32(_mm512_dpbusd_epi32(a, a, a));
#elif defined(PROBE_AVX512_BF16)
    __m512 a = _mm512_loadu_ps((const float *)vf);
    __m512bh h = _mm512_cvtne2ps_pbh(a, a);
    out_f = _mm512_reduce_add_ps(_mm512_dpbf16_ps(a, h, h));
#elif defined(PROBE_AMX)
    return amx_probe();
#else
#error "define one PROBE_<GROUP>"
#endif
    return 0;
}
