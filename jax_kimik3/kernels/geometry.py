"""Thread and vector geometry of the kernels, named once; imports no part of the CuTe DSL (the
kernel calls in jax.jit size their launches from it too)."""

from jax_kimik3.config import KIMI_K3

VECTOR = 8  # bf16 elements per thread access ...
VECTOR_BYTES = 2 * VECTOR  # ... 16 bytes, four 32-bit words: the mailboxes' word
WARP = 32
CLUSTER = 7  # CTAs per AttnRes cluster: one token row of H columns


def cta_threads(vector: int) -> int:
    """Threads per AttnRes CTA when each owns `vector` columns of the row."""
    return KIMI_K3.hidden_size // (CLUSTER * vector)


# Columns per thread of the standalone AttnRes and statistics kernels, which follow no
# mailbox word. Measured on an H100 (benchmarks/RESULTS.md, session 43): 8 is the fastest at
# every B and K tried. 4 (CTAs of 256 threads, shorter chains: 864 SASS instructions per
# thread at K = 8 against 1048) is 0.0-0.4 µs slower (3.33 against 3.10 µs at B = 8, K = 8),
# and 2 (512 threads, 2 CTAs per SM) 0.2-3.7 µs slower.
STANDALONE_VECTOR = 8
ROWS = 16  # rows of w per o_proj producer CTA: the mma's M
TOKENS = 8  # tokens per producer B tile: the mma's N
PRODUCER_WARPS = 8  # warps per producer CTA, each over K / PRODUCER_WARPS
# The o_proj producer stages its operands through shared memory (cp.async): a CTA takes
# STAGED_GROUPS 16-row groups of w (64 rows, so each x element crosses L2 once per 64 rows of
# w) and copies each STAGED_CHUNK-wide k chunk of its w rows and of x into one of
# STAGED_STAGES shared buffers while its two warpgroups multiply an earlier one on wgmma, each
# over half of each chunk's k. It does so at every K from STAGED_TILES[K] B tiles (absent:
# from one); below, each warp streams w into registers over K / 8, reads x through L1 and
# multiplies on mma.sync, as the fused tail's producer does at every B. Measured on the H200
# (benchmarks/RESULTS.md, session 31, staged on mma.sync), plain kernel µs staged against
# streamed:
# - B = 1 / 8 / 16: K = 768 4.64 / 4.59 / 4.80 against 4.41 / 4.61 / 5.23, K = 1536 7.59 /
#   7.22 / 7.33 against 7.42 / 7.61 / 8.74, K = 3072 12.83 / 12.64 / 13.04 against 13.41 /
#   14.06 / 15.43, K = 6144 23.26 / 23.14 / 23.90 against 23.78 / 26.26 / 27.33; one TP8
#   rank's split tail at B = 1 / 8 / 16: 12.51 / 12.68 / 13.38 against 12.16 / 12.70 / 13.99
#   (one TP16 rank's: 11.75 / 11.96 / 13.05 against 11.84 / 12.31 / 13.79). So one B tile
#   streams at K <= 1536, where B = 1 is faster streamed and B = 8 level.
# - B = 32 / 64 (against two streamed row groups per CTA): K = 1536 8.31 / 10.44 against
#   9.37 / 12.07, K = 6144 25.55 / 32.16 against 30.15 / 40.62; one TP8 rank's two-shot tail
#   16.93 / 21.48 against 17.61 / 23.28.
# wgmma against mma.sync on the staged operands, on an H100 (session 32): K = 1536 at B = 16 /
# 32 / 64: 9.24 / 9.67 / 10.10 against 9.33 / 10.12 / 11.05; K = 6144: 32.93 / 33.50 / 34.68
# against 32.97 / 34.46 / 36.23; one TP8 rank's two-shot tail at B = 64: 22.27 against 24.06.
# Staged on wgmma from one B tile at K = 1536 against streamed, on an H100 (session 33): plain
# kernel 8.96 / 8.87 against 9.27 / 9.54 at B = 1 / 8, one TP8 rank's split tail 14.53 / 14.95
# against 14.44 / 15.28; not yet measured on an H200, where the table was set.
STAGED_TILES = {768: 2, 1536: 2}
WARPGROUP = 4  # warps that issue one wgmma together
# A K-major operand row of the 128-byte shared-memory swizzle wgmma reads: 64 bf16 of k.
SWIZZLED_ROW_BYTES = 128
STAGED_GROUPS = WARPGROUP  # wgmma's M = 64 rows: one 16-row group per warp of a warpgroup
# 128: a 64-wide k half (one swizzled row) per warpgroup of the CTA
STAGED_CHUNK = PRODUCER_WARPS // WARPGROUP * SWIZZLED_ROW_BYTES // 2
# Five buffers: more chunks in flight than four, and they fit beside the epilogue's tile at
# every B tile count (214 KB at 8 tiles; six do not fit there). On an H100 (RESULTS.md,
# session 38), plain kernel µs at B = 16 / 32 / 64, five against four: K = 1536 9.10 / 9.37 /
# 9.91 against 9.20 / 9.64 / 10.05, K = 6144 32.05 / 32.88 / 34.10 against 32.90 / 33.56 /
# 34.63 (three: 0.5-2.4 µs slower than four); as many as fit, up to eight (eight up to four
# tiles): within 0.1 µs of four at B = 16-32.
STAGED_STAGES = 5
# The streamed producer's register budgets (.minnctapersm: CTAs per SM) at one B tile by K:
# (plain product, one-shot publish); none when it publishes two-shot. The budget decides how
# many weight loads ptxas issues ahead of their mma (K = 1536: 3 of a lane's 12 with none, at
# 40 registers; 8 with 4, at 64; 5 with 5, at 48). The plain product takes 4. The one-shot
# publish takes 5: an SM that holds three producer CTAs then still has room for one CTA of
# the tail's next kernel (AttnRes, a dependent launch, 128 threads of 122-162 registers),
# which at 4 starts only as producer CTAs retire. Measured on the H200 (benchmarks/RESULTS.md,
# session 22), µs at B = 1 / 8, without → with:
# - K = 1536: plain kernel 7.70 / 8.47 → 7.40 / 7.60; one TP8 rank's split tail 12.85 / 12.95
#   → 12.58 / 12.86;
# - K = 768: plain 4.63 / 4.97 → 4.38 / 4.60, tail 12.35 / 12.53 → 12.41 / 12.38.
PRODUCER_BUDGETS = {768: (4, 5), 1536: (4, 5)}
FUSED_CTAS_PER_SM = 4  # the fused tail's register cap (.minnctapersm): <= 64 registers
FUSED_POLLS_AHEAD = 1  # slots past the one it checks that the fused tail polls ahead (all: spills)
# Rows per rank up to which a tail's AttnRes kernel holds its inputs in registers across the poll
# (135 registers instead of 118: at B = 64 its grid leaves one wave; two-shot tails, 2 µs slower).
HOLDING_MAX_BATCH = 16
# Sources (saved blocks and p) up to which the logits' cluster exchange also carries each pair's
# Σv_i·v_j for the output norm, saving it an exchange: n(n-1)/2 more values, a loss above 4.
GRAM_MAX_SOURCES = 4
# A register budget (.minnctapersm) for the standalone AttnRes and statistics kernels: without
# one ptxas keeps them near 75 registers and issues the last saved blocks' loads only after the
# first ones have landed (two memory round trips at K = 8); with it, every load at once (123
# registers at K = 8), and a B = 64 grid (448 CTAs of 128 threads) still fits in one wave.
STANDALONE_CTAS_PER_SM = 4
FLAT_THREADS = 128  # per CTA of the flat Lamport kernels (publish, owner, consumer): a vector each
