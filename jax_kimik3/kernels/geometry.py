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
# (K, B tile count) pairs at which the o_proj producer has a register budget (.minnctapersm 4:
# 64 registers) unless it publishes two-shot, so that ptxas keeps more of a warp's weight
# loads in flight: the producer ends 0.3-0.6 µs sooner, but its CTAs then fill the SMs'
# registers and the tail's next kernel (a dependent launch) starts only as they retire. Split
# tail of one rank at two tiles (B = 12 and 16), against no budget in the same call: TP 8
# (K = 1536) 0.1-0.3 µs faster (the two-shot tail 0.4 µs slower); TP 4 (K = 3072) level to
# 0.2 µs slower; TP 16 (K = 768) 0.4-0.6 µs slower. At one tile (B = 1-8, TP 8), 0.45 µs
# slower at B = 8.
PRODUCER_BUDGETS = ((1536, 2),)
PRODUCER_CTAS_PER_SM = 4
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
