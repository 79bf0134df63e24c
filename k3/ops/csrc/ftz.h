/* Denormals as zero for the duration of a kernel, on the calling thread (each thread of an OpenMP team
 * sets its own: the mode is per thread). exp_poly.h's clamped lanes make subnormal intermediates (e.g.
 * x * sigmoid(-88) in a vectorised SiLU, computed for every lane before the select), and each costs a
 * ~150-cycle microcode assist on x86: a 512 x 256 SiLU took 0.85 ms with them, 0.04 ms without. Results
 * below 2^-126 (1.2e-38) become 0, far under fp32 rounding of anything the model computes. */
#ifndef K3_FTZ_H
#define K3_FTZ_H

#if defined(__x86_64__) || defined(__i386__)
static inline unsigned ftz_begin(void) {
    const unsigned mode = __builtin_ia32_stmxcsr();
    __builtin_ia32_ldmxcsr(mode | 0x8040u); /* FTZ (bit 15) and DAZ (bit 6) */
    return mode;
}
static inline void ftz_end(unsigned mode) { __builtin_ia32_ldmxcsr(mode); }
#else /* elsewhere the kernels run in the default mode */
static inline unsigned ftz_begin(void) { return 0; }
static inline void ftz_end(unsigned mode) { (void)mode; }
#endif

#endif
