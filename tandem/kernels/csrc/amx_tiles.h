/*
 * What every AMX kernel needs before its first tile instruction (amx_gemm.h,
 * prefill_attention_amx.h): the tile configuration's memory layout (palette 1) and the OS's
 * permission, which Linux grants per process on request (arch_prctl; kernels since 5.16).
 */
#ifndef TANDEM_AMX_TILES_H
#define TANDEM_AMX_TILES_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} AmxTileConfig;

/* Whether this process may use the tiles: the first call asks the OS (idempotent; racing
 * threads ask twice, which is harmless). */
static int amx_permitted(void) {
    static volatile int state = 0; /* 0 not asked, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}
#endif
