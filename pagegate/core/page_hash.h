/* A page's prefix-cache identity: SHA-256 (FIPS 180-4) of a length-prefixed record, cut to 64 bits.
 *
 * record = "PGPAGE1\0" | parent (u64 LE) | n (u32 LE) | n token ids (u32 LE each)
 *
 * NOTE: clients choose the tokens, salts and adapters whose pages meet in one shared cache (and in the tiers and
 * KV events), so the identity must be one nobody can aim: no invertible mixer, no string join. Fixed-width fields
 * and an explicit count make the record unambiguous; every hit is still confirmed against the stored parent and
 * tokens (block_pool.pyx), so reaching a victim's page needs a 64-bit second preimage of SHA-256.
 */
#ifndef PAGEGATE_PAGE_HASH_H
#define PAGEGATE_PAGE_HASH_H

#include <stdint.h>
#include <string.h>

static const uint32_t pg_sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static inline uint32_t pg_ror(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }

static void pg_sha256_block(uint32_t state[8], const uint8_t block[64]) {
    uint32_t w[64], a, b, c, d, e, f, g, h, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = (uint32_t)block[4 * i] << 24 | (uint32_t)block[4 * i + 1] << 16 |
               (uint32_t)block[4 * i + 2] << 8 | (uint32_t)block[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = pg_ror(w[i - 15], 7) ^ pg_ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = pg_ror(w[i - 2], 17) ^ pg_ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = state[0]; b = state[1]; c = state[2]; d = state[3];
    e = state[4]; f = state[5]; g = state[6]; h = state[7];
    for (i = 0; i < 64; i++) {
        t1 = h + (pg_ror(e, 6) ^ pg_ror(e, 11) ^ pg_ror(e, 25)) + ((e & f) ^ (~e & g)) + pg_sha256_k[i] + w[i];
        t2 = (pg_ror(a, 2) ^ pg_ror(a, 13) ^ pg_ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    state[0] += a; state[1] += b; state[2] += c; state[3] += d;
    state[4] += e; state[5] += f; state[6] += g; state[7] += h;
}

/* SHA-256 streamed in through pg_sha256_put. */
typedef struct {
    uint32_t state[8];
    uint8_t buf[64];
    uint64_t total;
    int used;
} pg_sha256;

static inline void pg_sha256_init(pg_sha256* s) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->state, iv, sizeof(iv));
    s->total = 0;
    s->used = 0;
}

static inline void pg_sha256_put(pg_sha256* s, const uint8_t* p, size_t n) {
    s->total += n;
    while (n) {
        size_t take = 64 - (size_t)s->used < n ? 64 - (size_t)s->used : n;
        memcpy(s->buf + s->used, p, take);
        s->used += (int)take;
        p += take;
        n -= take;
        if (s->used == 64) {
            pg_sha256_block(s->state, s->buf);
            s->used = 0;
        }
    }
}

static inline void pg_sha256_u32le(pg_sha256* s, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    pg_sha256_put(s, b, 4);
}

static inline void pg_sha256_u64le(pg_sha256* s, uint64_t v) {
    pg_sha256_u32le(s, (uint32_t)v);
    pg_sha256_u32le(s, (uint32_t)(v >> 32));
}

/* The digest's first 8 bytes, read little-endian. */
static inline uint64_t pg_sha256_first64(pg_sha256* s) {
    uint64_t bits = s->total * 8, out = 0;
    uint8_t pad = 0x80, zero = 0;
    int i;
    pg_sha256_put(s, &pad, 1);
    while (s->used != 56)
        pg_sha256_put(s, &zero, 1);
    for (i = 7; i >= 0; i--) {
        uint8_t b = (uint8_t)(bits >> (8 * i));
        pg_sha256_put(s, &b, 1);
    }
    for (i = 7; i >= 0; i--)  /* digest bytes 0..7 are state[0] and state[1], big-endian */
        out = out << 8 | (uint8_t)(s->state[i / 4] >> (8 * (3 - i % 4)));
    return out;
}

static inline uint64_t pg_page_hash(uint64_t parent, const int32_t* tokens, int n) {
    static const uint8_t tag[8] = {'P', 'G', 'P', 'A', 'G', 'E', '1', 0};
    pg_sha256 s;
    int i;
    pg_sha256_init(&s);
    pg_sha256_put(&s, tag, 8);
    pg_sha256_u64le(&s, parent);
    pg_sha256_u32le(&s, (uint32_t)n);
    for (i = 0; i < n; i++)
        pg_sha256_u32le(&s, (uint32_t)tokens[i]);
    return pg_sha256_first64(&s);
}

#endif
