/*
 * How the packed GEMMs (int8_gemm.c, dense_gemm.c) share a product between threads: work items
 * are panels of PANEL_BLOCKS column blocks, and where there are too few panels for every
 * thread to get several, each panel's rows are split into groups too (a panel's weights are
 * then read once a group). A group is a whole number of TILE_ROWS-row tiles.
 */
#ifndef TANDEM_GEMM_SPLIT_H
#define TANDEM_GEMM_SPLIT_H
#include <stdint.h>

typedef struct {
    int64_t panels, groups, group_rows; /* items = panels * groups */
} GemmSplit;

static inline GemmSplit gemm_split(int64_t rows, int64_t blocks, int64_t panel_blocks, int64_t tile_rows,
                                   int num_threads) {
    GemmSplit split = {(blocks + panel_blocks - 1) / panel_blocks, 1, 0};
    const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
    while (split.groups < tiles && split.panels * split.groups < 8 * num_threads) split.groups *= 2;
    if (split.groups > tiles) split.groups = tiles > 0 ? tiles : 1;
    split.group_rows = (tiles + split.groups - 1) / split.groups * tile_rows;
    return split;
}
/* BODY once for every tile of the product, the items spread over `num_threads` threads (a
 * variable of the caller's); BODY sees m (the tile's first row), rows (its rows), block (its
 * first column block) and width (its blocks), and `ahead` / `ahead_lines`: this tile's share
 * of the next panel's 64-byte lines (PACKED: the packed matrix, BLOCK_BYTES: one block's
 * bytes), which the tile prefetches while it multiplies. Why: the first tile over a panel
 * otherwise streams it from memory at a fraction of the rate the later tiles multiply at
 * (the panel is then in L2); spread over the previous panel's tiles, the stream overlaps
 * their arithmetic. A thread's static share of the items is consecutive, so its next item
 * is the next panel (or the same panel's next row group, where the lines are already in). */
#define GEMM_FOR_EACH_TILE(M, BLOCKS, PANEL_BLOCKS, TILE_ROWS, PACKED, BLOCK_BYTES, BODY)                \
    do {                                                                                                  \
        const GemmSplit split_ = gemm_split((M), (BLOCKS), (PANEL_BLOCKS), (TILE_ROWS), num_threads);     \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                            \
        for (int64_t item_ = 0; item_ < split_.panels * split_.groups; item_++) {                         \
            const int64_t block = item_ / split_.groups * (PANEL_BLOCKS);                                 \
            const int64_t first_ = item_ % split_.groups * split_.group_rows;                             \
            const int64_t width = (BLOCKS) - block < (PANEL_BLOCKS) ? (BLOCKS) - block : (PANEL_BLOCKS);  \
            const int64_t end_ = first_ + split_.group_rows < (M) ? first_ + split_.group_rows : (M);     \
            const int64_t next_ = block + (PANEL_BLOCKS);                                                 \
            const int64_t next_lines_ = next_ < (BLOCKS) && split_.groups == 1                            \
                ? ((BLOCKS) - next_ < (PANEL_BLOCKS) ? (BLOCKS) - next_ : (PANEL_BLOCKS)) * (BLOCK_BYTES) / 64 : 0; \
            const int64_t tiles_ = (end_ - first_ + (TILE_ROWS) - 1) / (TILE_ROWS);                       \
            const int64_t share_ = tiles_ > 0 ? (next_lines_ + tiles_ - 1) / tiles_ : 0;                  \
            for (int64_t m = first_; m < end_; m += (TILE_ROWS)) {                                        \
                const int64_t rows = end_ - m < (TILE_ROWS) ? end_ - m : (TILE_ROWS);                     \
                const int64_t done_ = (m - first_) / (TILE_ROWS) * share_;                                \
                const int64_t ahead_lines = done_ >= next_lines_ ? 0                                      \
                    : (next_lines_ - done_ < share_ ? next_lines_ - done_ : share_);                      \
                const char *ahead = (const char *)(PACKED) + next_ * (BLOCK_BYTES) + done_ * 64;          \
                BODY;                                                                                     \
            }                                                                                             \
        }                                                                                                 \
    } while (0)
#endif
