/* Integer-block rows interleaved eight at a time: the layout the native step reads Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
   the K-quants (Q4_K, Q5_K, Q6_K) in.

   The loader repacks such a matrix once (pgq_x8_pack): each group of eight rows keeps, super-block by
   super-block, the very bytes the file has, each field of the block (a scale, the packed values) stored unit by
   unit with the eight rows side by side: unit u of row i at the field's start + (8 u + i) * unit bytes. One 32-byte
   load then holds the same four bytes of all eight rows, a vector lane a row, so the integer dot products land per
   row in the lanes without horizontal adds, and the scales of eight rows are one vector (cpu_qx8_isa.h's
   pgq_x8_dot). A matrix of N rows keeps N / 8 groups, then its last N % 8 rows as the file has them, each at its
   own offset; it is as large as the file's (a permutation of its bytes, Q8_0's values flipped).

   A repacked matrix says so by its type id: the ggml id plus PGQ_X8 (an id of pagegate's, never in a file).
   Q8_0's values are kept plus 128 (the XOR of their sign bits), as the unsigned side of the integer products. */
#ifndef PAGEGATE_CPU_QX8_H
#define PAGEGATE_CPU_QX8_H

#include <stdint.h>
#include <string.h>

enum { PGQ_X8 = 100, PGQ_X8_ROWS = 8 };
#ifndef PGQ_X8_AHEAD
#define PGQ_X8_AHEAD 2  /* super-blocks ahead a kernel's first pass prefetches (cpu_qx8_isa.h) */
#endif

typedef struct {
    int offset, bytes, unit;  /* where the field lies in the file's block, its bytes a row, the bytes of a unit */
    int flip;                 /* 1: each byte's top bit flipped (int8 -> uint8 + 128) */
} pgq_x8_field;

/* The fields of a block in file order; the number of them (0: a type kept as the file has it). */
static int pgq_x8_fields(int base, const pgq_x8_field **fields) {
    static const pgq_x8_field q4_0[] = {{0, 2, 2}, {2, 16, 4}};
    static const pgq_x8_field q4_1[] = {{0, 2, 2}, {2, 2, 2}, {4, 16, 4}};
    static const pgq_x8_field q5_0[] = {{0, 2, 2}, {2, 4, 4}, {6, 16, 4}};
    static const pgq_x8_field q5_1[] = {{0, 2, 2}, {2, 2, 2}, {4, 4, 4}, {8, 16, 4}};
    static const pgq_x8_field q8_0[] = {{0, 2, 2}, {2, 32, 4, 1}};
    static const pgq_x8_field q4_k[] = {{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 128, 4}};
    static const pgq_x8_field q5_k[] = {{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 32, 4}, {48, 128, 4}};
    static const pgq_x8_field q6_k[] = {{0, 128, 4}, {128, 64, 4}, {192, 16, 1}, {208, 2, 2}};
    switch (base) {
        case 2: *fields = q4_0; return 2;
        case 3: *fields = q4_1; return 3;
        case 6: *fields = q5_0; return 3;
        case 7: *fields = q5_1; return 4;
        case 8: *fields = q8_0; return 2;
        case 12: *fields = q4_k; return 4;
        case 13: *fields = q5_k; return 5;
        case 14: *fields = q6_k; return 4;
        default: *fields = NULL; return 0;
    }
}

static inline int pgq_is_x8(int qtype) { return qtype > PGQ_X8; }
static inline int pgq_base_type(int qtype) { return pgq_is_x8(qtype) ? qtype - PGQ_X8 : qtype; }

/* Copy row i's block (file layout, `file`) into a group's block (`group`, 8 blocks' bytes), or back (`to_file`). */
static void pgq_x8_block(int base, uint8_t *group, uint8_t *file, int i, int to_file) {
    const pgq_x8_field *fields;
    const int count = pgq_x8_fields(base, &fields);
    int start = 0;
    for (int f = 0; f < count; f++) {
        const pgq_x8_field field = fields[f];
        for (int u = 0; u < field.bytes / field.unit; u++) {
            uint8_t *at = group + start + (PGQ_X8_ROWS * u + i) * field.unit, *in = file + field.offset + u * field.unit;
            uint8_t *to = to_file ? in : at;
            memcpy(to, to_file ? at : in, field.unit);
            for (int b = 0; b < field.unit && field.flip; b++) to[b] ^= 0x80;
        }
        start += PGQ_X8_ROWS * field.bytes;
    }
}

/* `units` units of `unit` bytes of each of eight rows' field (at rows[i] + at) into out, unit by unit, the eight rows
   side by side; returns the end of what it wrote. Inlined with constant sizes, each copy is one load and store. */
static inline uint8_t *pgq_x8_units(uint8_t *out, const uintptr_t *rows, int64_t at, int units, const int unit,
                                    const int flip) {
    for (int u = 0; u < units; u++)
        for (int i = 0; i < PGQ_X8_ROWS; i++, out += unit) {
            uint32_t value = 0;
            memcpy(&value, (const uint8_t *)rows[i] + at + u * unit, unit);
            if (flip) value ^= 0x80808080u;
            memcpy(out, &value, unit);
        }
    return out;
}

/* Eight rows of `base` blocks (row_bytes each, at the addresses rows[0..7]) into one group at out (8 row_bytes):
   pgq_x8_block's layout, written front to back. */
static void pgq_x8_pack(int base, const uintptr_t *rows, int64_t row_bytes, uint8_t *out) {
    const pgq_x8_field *fields;
    const int count = pgq_x8_fields(base, &fields), bytes = pgq_block_bytes(base);
    int units[8];
    for (int f = 0; f < count; f++) units[f] = fields[f].bytes / fields[f].unit;  /* once, not once a block */
    for (int64_t at = 0; at + bytes <= row_bytes; at += bytes)
        for (int f = 0; f < count; f++) {
            const pgq_x8_field field = fields[f];
            if (field.flip) out = pgq_x8_units(out, rows, at + field.offset, units[f], 4, 1);  /* Q8_0's values */
            else if (field.unit == 4) out = pgq_x8_units(out, rows, at + field.offset, units[f], 4, 0);
            else if (field.unit == 2) out = pgq_x8_units(out, rows, at + field.offset, units[f], 2, 0);
            else out = pgq_x8_units(out, rows, at + field.offset, units[f], 1, 0);
        }
}

/* Row r of a matrix of n rows in `qtype` as its file has it: in place, or copied out of its group into buf. */
static const uint8_t *pgq_row_at(int qtype, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t r, uint8_t *buf) {
    if (!pgq_is_x8(qtype) || r >= n / PGQ_X8_ROWS * PGQ_X8_ROWS) return w + r * row_bytes;
    const int base = pgq_base_type(qtype), bytes = pgq_block_bytes(base);
    const uint8_t *group = w + (r / PGQ_X8_ROWS) * PGQ_X8_ROWS * row_bytes;
    for (int64_t s = 0; s < row_bytes / bytes; s++)
        pgq_x8_block(base, (uint8_t *)group + s * PGQ_X8_ROWS * bytes, buf + s * bytes, (int)(r % PGQ_X8_ROWS), 1);
    return buf;
}

#endif /* PAGEGATE_CPU_QX8_H */
