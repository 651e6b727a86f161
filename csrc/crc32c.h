/* CRC32C (Castagnoli: reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; the
 * checksum of iSCSI, ext4 and Btrfs metadata) for the disk tier's per-page checksums. Included by
 * pread_pool.c, which exposes it to Python (engram/store/crc32c.py).
 *
 * x86-64 CPUs with SSE4.2 run the crc32 instruction 8 bytes at a time (chosen at run time with
 * __builtin_cpu_supports, so the file builds with the default flags); every other CPU runs a portable
 * slicing-by-8 table loop. Both give the same value; crc32c_update continues a previous result the way
 * zlib.crc32(data, crc) does.
 */
#ifndef ENGRAM_CRC32C_H
#define ENGRAM_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CRC32C_POLY 0x82F63B78u

static uint32_t crc32c_table[8][256];
static int crc32c_hw;  /* 1 when the SSE4.2 path is used */

static uint32_t crc32c_sw(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        crc = crc32c_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= crc;
        crc = crc32c_table[7][w & 0xff] ^ crc32c_table[6][(w >> 8) & 0xff] ^
              crc32c_table[5][(w >> 16) & 0xff] ^ crc32c_table[4][(w >> 24) & 0xff] ^
              crc32c_table[3][(w >> 32) & 0xff] ^ crc32c_table[2][(w >> 40) & 0xff] ^
              crc32c_table[1][(w >> 48) & 0xff] ^ crc32c_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc32c_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define CRC32C_HAVE_HW 1
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
#endif

/* Fills the tables and picks the implementation; call once before crc32c_update. */
static void crc32c_init(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1u)));
        crc32c_table[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int t = 1; t < 8; t++)
            crc32c_table[t][b] = crc32c_table[0][crc32c_table[t - 1][b] & 0xff] ^ (crc32c_table[t - 1][b] >> 8);
#ifdef CRC32C_HAVE_HW
    __builtin_cpu_init();
    crc32c_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
}

/* CRC32C of p[0:n] continuing from `crc` (0 to start). */
static uint32_t crc32c_update(uint32_t crc, const void *p, size_t n) {
    crc = ~crc;
#ifdef CRC32C_HAVE_HW
    if (crc32c_hw) return ~crc32c_sse42(crc, (const unsigned char *)p, n);
#endif
    return ~crc32c_sw(crc, (const unsigned char *)p, n);
}

#endif /* ENGRAM_CRC32C_H */
