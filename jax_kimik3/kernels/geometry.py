"""Thread and vector geometry of the kernels, named once; imports no part of the CuTe DSL (the
kernel calls in jax.jit size their launches from it too)."""

from jax_kimik3.config import KIMI_K3

VECTOR = 8  # bf16 elements per thread access ...
VECTOR_BYTES = 2 * VECTOR  # ... 16 bytes, four 32-bit words
WARP = 32
CLUSTER = 7  # CTAs per AttnRes cluster: one token row of H columns
THREADS = KIMI_K3.hidden_size // (CLUSTER * VECTOR)  # 128 per AttnRes CTA, a vector each
ROWS = 16  # rows of w per o_proj producer CTA: the mma's M
TOKENS = 8  # tokens per producer B tile: the mma's N
PRODUCER_WARPS = 8  # warps per producer CTA, each over K / PRODUCER_WARPS
# The o_proj producer's register budgets (.minnctapersm: CTAs per SM) by (K, B tile count):
# (plain product, one-shot publish); None or absent: none, and none when it publishes
# two-shot. The budget decides how many weight loads ptxas issues ahead of their mma (K =
# 1536, one tile: 3 of a lane's 12 with none, at 40 registers; 8 with 4, at 64; 5 with 5, at
# 48). The plain product takes 4. The one-shot publish takes 5: an SM that holds three
# producer CTAs then still has room for one CTA of the tail's next kernel (AttnRes, a
# dependent launch, 128 threads of 122-162 registers), which at 4 starts only as producer CTAs
# retire. Measured on the H200 (benchmarks/RESULTS.md, session 22), µs at B = 1 / 8 / 16,
# without → with:
# - K = 1536: plain kernel 7.70 / 8.47 / 8.69 → 7.40 / 7.60 / 8.69; one TP8 rank's split tail
#   12.85 / 12.95 / 14.35 → 12.58 / 12.86 / 14.25 (B = 16: against 4, the budget before);
# - K = 3072, one tile: plain 13.47 / 14.36 → 13.32 / 13.88, tail 18.42 / 18.70 → 17.35 /
#   17.80 (at two tiles 5 made the tail 4.2 µs slower and 4 the kernel 0.9);
# - K = 768: plain 4.63 / 4.97 → 4.38 / 4.60 (at two tiles 0.2 slower), tail 12.35 / 12.53 /
#   14.91 → 12.41 / 12.38 / 14.73.
PRODUCER_BUDGETS = {(768, 1): (4, 5), (768, 2): (None, 5), (1536, 1): (4, 5),
                    (1536, 2): (4, 5), (3072, 1): (4, 5)}
# B tiles from which a producer CTA takes two 16-row groups of w (224 CTAs per rank), so that
# each x load, which every CTA makes from L2, feeds twice the rows. With it, one TP8 rank's
# two-shot tail: B = 32 17.8 µs against 21.1, B = 64 23.3 against 26.1 (same call). Its
# register budget: two CTAs per SM (<= 128 registers; 138 without), all 224 in one wave.
PRODUCER_GROUPED_TILES = 4
PRODUCER_GROUPED_CTAS_PER_SM = 2
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
